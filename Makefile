# `make run` and `make test` work on a fresh machine: both bootstrap first (scripts/bootstrap.sh).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap run test lint format protos bench clean

bootstrap:
	@bash scripts/bootstrap.sh

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: bootstrap
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

run: bootstrap
	@bash examples/run_main.sh

protos: bootstrap
	$(PY) -m millstream.common.protogen

bench: bootstrap
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
