#!/usr/bin/env bash
# Idempotent set-up for `make run` and `make test` on a fresh machine:
#   1. a .venv with Python 3.11
#   2. torch==2.13.0 FIRST (any other pin, or an unpinned torch pulled in by another package,
#      drags in gigabytes of CUDA packages)
#   3. millstream in editable mode with its extras, at the versions of scripts/constraints.txt
#      (what make test was last green with), re-installed only when either file changes
#   4. the lowest transformers it claims, in .venv/floor (for tests/integration/trainer/test_transformers_floor.py)
#   5. SGLang's package for the contract tier, in .venv/sglang (scripts/sglang-contract.txt)
#   6. a redis-server binary (Debian's package when none is on PATH)
# A second call checks each step and skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY="$VENV/bin/python"
TORCH_PIN="torch==2.13.0"
say() { printf '[bootstrap] %s\n' "$*"; }

if [ ! -x "$PY" ]; then
  PYTHON=${PYTHON:-python3.11}
  command -v "$PYTHON" >/dev/null || PYTHON=python3
  "$PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 11), sys.version' \
    || { say "need Python >= 3.11 (found $("$PYTHON" --version))"; exit 1; }
  say "creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi

if ! "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  say "installing $TORCH_PIN (CPU build) before anything else"
  "$PY" -m pip install -q --disable-pip-version-check "$TORCH_PIN"
fi

CONSTRAINTS=scripts/constraints.txt
STAMP="$VENV/.millstream-$(cat pyproject.toml "$CONSTRAINTS" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  say "installing millstream (editable) with extras [all,dev], versions from $CONSTRAINTS"
  # Naming the torch pin again keeps pip's resolver from replacing it.
  "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" -e '.[all,dev]' "$TORCH_PIN"
  rm -f "$VENV"/.millstream-*
  touch "$STAMP"
fi

# The lowest transformers the engine and the trainer claim (pyproject.toml; the GPU image has it),
# beside the venv's: tests/integration/trainer/test_transformers_floor.py runs the engine's tests on it.
FLOOR=$VENV/floor
FLOOR_PINS="transformers==5.17.0 huggingface_hub==1.33.0"
if [ ! -f "$FLOOR/.done-${FLOOR_PINS// /_}" ]; then
  say "installing $FLOOR_PINS into $FLOOR (the transformers floor, for its test)"
  rm -rf "$FLOOR"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$FLOOR" $FLOOR_PINS
  touch "$FLOOR/.done-${FLOOR_PINS// /_}"
fi

# SGLang's own classes judge what millstream sends an SGLang server (tests/contract/): its package
# and the few it imports, pinned, without dependencies, in a folder of their own (never on the
# venv's path: an importable sglang makes the launcher start SGLang servers).
SGLANG_DIR=$VENV/sglang
SGLANG_STAMP="$SGLANG_DIR/.done-$(sha256sum scripts/sglang-contract.txt | cut -c1-16)"
if [ ! -f "$SGLANG_STAMP" ]; then
  say "installing SGLang's package for the contract tier into $SGLANG_DIR (scripts/sglang-contract.txt, no dependencies)"
  rm -rf "$SGLANG_DIR"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$SGLANG_DIR" \
    -r scripts/sglang-contract.txt
  touch "$SGLANG_STAMP"
fi
"$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' \
  || { say "torch is no longer 2.13.0 after the installs: $("$PY" -c 'import torch; print(torch.__version__)')"; exit 1; }

if ! command -v redis-server >/dev/null; then
  say "redis-server not on PATH: installing Debian's redis-server package"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  # The package starts a system service where systemd runs; millstream starts its own.
fi
say "ready: $("$PY" --version), torch $("$PY" -c 'import torch; print(torch.__version__)'), $(redis-server --version | cut -d' ' -f1-3)"
