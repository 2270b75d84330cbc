# Common commands; `make help` lists them.
PY ?= .venv/bin/python
.DEFAULT_GOAL := help

help: ## List the common commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: ## Create .venv and install the project with its dev tools
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'

proto: ## Regenerate the Python stubs from proto/
	$(PY) -m service.stubs generate

serve: ## Run the service (embedded Postgres unless DATABASE_URL is set)
	.venv/bin/genq serve

test: ## Run the tests (needs Postgres on 127.0.0.1:5432 and Redis on 127.0.0.1:6379)
	$(PY) -m pytest

lint: ## ruff, mypy, stub drift and buf lint
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy service workers_sdk tests bench
	$(PY) -m service.stubs check

format: ## Format the code with ruff
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

bench: ## Claim+complete over gRPC against the same SQL through psycopg
	$(PY) bench/claim_complete.py

.PHONY: help install proto serve test lint format bench
