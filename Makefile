# Common commands; `make help` lists them.
PY ?= .venv/bin/python
.DEFAULT_GOAL := help

help: ## List the common commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: .venv/.installed ## Create .venv with the project and its dev tools (buf included)

# Python alone: pip installs everything, the proto linter too.
.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

proto: .venv/.installed ## Regenerate the Python stubs from proto/
	$(PY) proto/build.py generate

serve: .venv/.installed ## Run the service (embedded Postgres unless DATABASE_URL is set)
	.venv/bin/genq serve

test: .venv/.installed ## Run the tests (Postgres on :5432, Redis on :6379, chromium, faketime)
	$(PY) -m pytest

lint: .venv/.installed ## ruff, mypy, stub drift and buf lint
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy service workers_sdk tests bench examples proto/build.py
	$(PY) proto/build.py check
	.venv/bin/buf lint

format: ## Format the code with ruff
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

bench: .venv/.installed ## Single-task path: the service against psycopg, pgbench and itself without middleware
	$(PY) bench/claim_complete.py

.PHONY: help install proto serve test lint format bench
