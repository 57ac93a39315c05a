# `make run` and `make test` work on a fresh machine: both bootstrap first (scripts/bootstrap.sh).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: bootstrap run test lint format protos bench chaos clean compose-up compose-down compose-test

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

# The chaos suite at full length (about 15 minutes): kills, restarts, poison; prints its table.
chaos: bootstrap
	$(PY) -m tests.chaos

bench: bootstrap
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# docker compose on one node (deploy/compose/): build and start the arith example, or stop it.
COMPOSE = $(VENV)/bin/python -c 'import compose, os, sys; b = os.path.join(os.path.dirname(compose.__file__), "docker-compose"); os.execv(b, [b, *sys.argv[1:]])' -f deploy/compose/compose.yml --env-file deploy/compose/.env

deploy/compose/.env:
	@printf 'REDIS_PASSWORD=%s\nADMIN_TOKEN=%s\nCOMPOSE_PROFILES=cpu\n' "$$(head -c 18 /dev/urandom | base64 | tr -d '/+=')" "$$(head -c 18 /dev/urandom | base64 | tr -d '/+=')" > $@
	@echo "wrote $@ (a random REDIS_PASSWORD and ADMIN_TOKEN; COMPOSE_PROFILES=cpu)"

compose-up: bootstrap deploy/compose/.env
	$(COMPOSE) up -d --build
	@echo "trainer rows: $(COMPOSE) logs -f trainer"

compose-down: bootstrap deploy/compose/.env
	$(COMPOSE) down -v

compose-test: bootstrap
	@bash scripts/compose_smoke.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
