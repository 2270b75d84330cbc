# Common commands; `make help` lists them.
PY ?= .venv/bin/python
.DEFAULT_GOAL := help

help: ## List the common commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: .venv/.installed .tools/.installed ## Create .venv (the project, its dev tools) and buf (npm)

# Python alone: all `make serve` needs.
.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# The proto linter, for `make lint` and the contract test; the only use of npm.
.tools/.installed:
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0
	touch $@

proto: .venv/.installed ## Regenerate the Python stubs from proto/
	$(PY) proto/build.py generate

serve: .venv/.installed ## Run the service (embedded Postgres unless DATABASE_URL is set)
	.venv/bin/genq serve

test: .venv/.installed .tools/.installed ## Run the tests (Postgres on :5432, Redis on :6379, chromium, faketime)
	$(PY) -m pytest

lint: .venv/.installed .tools/.installed ## ruff, mypy, stub drift and buf lint
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy service workers_sdk tests bench examples proto/build.py
	$(PY) proto/build.py check
	.tools/node_modules/.bin/buf lint

format: ## Format the code with ruff
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

bench: .venv/.installed ## Claim+complete over gRPC against the same SQL through psycopg
	$(PY) bench/claim_complete.py

.PHONY: help install proto serve test lint format bench
