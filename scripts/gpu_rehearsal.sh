#!/usr/bin/env bash
# `make gpu-rehearsal`: `make gpu-check`'s set-up and stages on this CPU, in the GPU machine's
# own Python and packages, before a GPU window is spent on them. The lent machine runs
# millstream under its image's Python 3.12 with torch 2.11.0+cu130 and transformers 5.17
# (scripts/gpu_image.txt) and the carried wheels (.gpu/), where make test runs Python 3.11,
# torch 2.13 and transformers 5.24: a skew between the two shows here, on the CPU.
#   1. a venv of Python 3.12 (REHEARSAL_PYTHON, else python3.12, else pyenv's) with
#      scripts/gpu_rehearsal.txt installed from PyPI: the image's packages at its versions
#      (torch's +cu130 build runs on the CPU; about 5 GB, once per list);
#   2. make gpu-bundle for Python 3.12: the .gpu/ a GPU window carries;
#   3. scripts/gpu_check.sh --device cpu --small with that venv's python3 first on PATH: the
#      .gpu branch of the set-up, the import sweep, then every stage (ARGS go on to it).
# Out: runs/gpu-rehearsal (OUT=DIR for another). The venv: ~/.cache/millstream (REHEARSAL_VENV).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[gpu-rehearsal] %s\n' "$*" >&2; }
PYV=3.12
REQ=scripts/gpu_rehearsal.txt

# The first that runs as 3.12 (a pyenv shim of python3.12 may be on PATH and refuse to run).
python=
for candidate in ${REHEARSAL_PYTHON:-} "python$PYV" \
    $(command -v pyenv >/dev/null && ls -d "$(pyenv root)/versions/$PYV".*/bin/python$PYV 2>/dev/null || true); do
  if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null; then
    python=$candidate && break
  fi
done
[ -n "$python" ] || { say "no Python $PYV here (the GPU image's): set REHEARSAL_PYTHON"; exit 2; }

VENV=${REHEARSAL_VENV:-$HOME/.cache/millstream/gpu-image-py$PYV-$(sha256sum "$REQ" | cut -c1-12)}
if [ ! -f "$VENV/.done" ]; then
  say "installing $REQ into $VENV with $("$python" --version) (about 5 GB, once)"
  rm -rf "$VENV"
  "$python" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-cache-dir -r "$REQ"
  touch "$VENV/.done"
fi

GPU_PYTHON=$PYV bash scripts/gpu_bundle.sh
# As on the GPU machine: nothing of this checkout's venv, its image's python3 first.
unset PY PYTHONPATH PYTHONHOME VIRTUAL_ENV MILLSTREAM MILLSTREAM_COMMIT
export PATH="$VENV/bin:$PATH" GPU_SITE="$VENV.site"
exec bash scripts/gpu_check.sh --device cpu --small --no-docs --out "${OUT:-runs/gpu-rehearsal}" "$@"
