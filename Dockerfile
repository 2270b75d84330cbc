# One image for the data plane (`genq serve`), the example worker (`python examples/worker.py`)
# and the reconciler (`genq reconcile`); docker-compose.yml runs them all from it.
# The gRPC stubs in generation/ are committed, so no protoc is needed.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app
# PYTHONPATH: the commands import the project from /app, not from the installed copy in
# site-packages, because `genq serve` migrates with the alembic.ini it finds next to the
# `service` package (service/migrations.py), and alembic.ini and alembic/ are not packaged.

WORKDIR /app
COPY . .
RUN pip install '.[service]' \
    && useradd --system --no-create-home --uid 10001 genq

USER genq
EXPOSE 50051 8080
CMD ["genq", "serve"]
