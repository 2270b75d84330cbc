"""The HTTP page, served beside gRPC on GENQ_HTTP_PORT by the process that owns the port: the
read-only status page, /status.json, /metrics and /healthz (app.py), drawn from the Jinja2
templates in templates/.
"""
