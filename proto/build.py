"""Generate the Python stubs of proto/ into generation/, or check that the committed ones match.

    python proto/build.py generate   # after editing a .proto
    python proto/build.py check      # fails when generation/ drifts from proto/ (CI runs it)

The stubs are committed so that a worker host needs no protoc; nobody edits them by hand.
"""

import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
OUT = ROOT / "generation"
BIN = Path(sys.executable).parent


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO}",
            f"--plugin=protoc-gen-mypy={BIN / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={BIN / 'protoc-gen-mypy_grpc'}",
            f"--python_out={out}",
            f"--mypy_out={out}",
            f"--grpc_python_out={out}",
            f"--mypy_grpc_out={out}",
            *protos,
        ],
        check=True,
        cwd=PROTO,
        capture_output=True,  # mypy-protobuf narrates every file it writes
    )
    for folder in [out / "generation", *(p for p in (out / "generation").rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()


def differences(left: Path, right: Path) -> list[str]:
    cmp = filecmp.dircmp(left, right, ignore=["__pycache__"])
    found = [f"{left / n}" for n in cmp.left_only + cmp.right_only + cmp.diff_files]
    for name in cmp.common_dirs:
        found += differences(left / name, right / name)
    return found


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "generate"
    if command == "generate":
        generate(ROOT)
        return 0
    if command == "check":
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            drift = differences(Path(tmp) / "generation", OUT)
        if drift:
            print("generated stubs drift from proto/; run `make proto`:", *drift, sep="\n  ")
            return 1
        print("generated stubs match proto/")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
