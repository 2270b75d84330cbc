"""Programs that print measured figures (docs/BENCHMARKS.md); run each as a script."""
