#!/usr/bin/env bash
# `make gpu-check` (bench/gpu_check.py): every GPU path once on one NVIDIA GPU, one table.
# Set-up from what the machine has, in this order:
#   1. .gpu/ (made by scripts/gpu_bundle.sh where there is network, carried to a GPU machine
#      that has none; GPU_BUNDLE=DIR for another), when no $PY is given and python3 is the
#      Python it was made for: its wheels go to $GPU_SITE (/tmp/millstream-site) once,
#      `import millstream` resolves to this checkout's services/, redis-server and a
#      `millstream` command come from the bundle's bin/, the commit from its `commit` file;
#      then every module the run imports is imported once (bench/gpu_imports.py), so a wheel
#      the bundle lacks stops the check here, named, before any stage (GPU_IMPORTS_SKIP: the
#      CPU dry run's modules to leave out); then bench/gpu_api.py names any torch name or
#      keyword millstream uses that the machine's torch lacks, and the check goes on;
#   2. else $PY, else .venv/bin/python, else python3: it must import millstream already
#      (pip install -e '.[all]' into a Python that has CUDA torch keeps that torch).
# Arguments go to bench/gpu_check.py (--device cpu --small: the plumbing without a GPU). Its
# --budget-s counts from this script's start (MILLSTREAM_GPU_CHECK_T0): set-up is in the window.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[gpu-check] %s\n' "$*" >&2; }
start=$SECONDS
MILLSTREAM_GPU_CHECK_T0=$(date +%s) && export MILLSTREAM_GPU_CHECK_T0

G=${GPU_BUNDLE:-$PWD/.gpu}
BUNDLE_PY=$(cat "$G/python-version" 2>/dev/null || true)
if [ -z "${PY:-}" ] && [ -d "$G/whl" ] && [ -n "$BUNDLE_PY" ] \
   && python3 -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$BUNDLE_PY')"; then
  SITE=${GPU_SITE:-/tmp/millstream-site}
  stamp="$SITE/.done-$(ls "$G/whl" | cksum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ]; then
    say "installing the carried wheels into $SITE/site"
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$SITE/site" "$G"/whl/*.whl
    touch "$stamp"
  fi
  mkdir -p "$SITE/pkg"
  ln -sfn "$PWD/services" "$SITE/pkg/millstream"
  export PYTHONPATH="$SITE/pkg:$PWD:$SITE/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$G/bin:$PATH" MILLSTREAM="$G/bin/millstream"
  if [ -z "${MILLSTREAM_COMMIT:-}" ] && [ -f "$G/commit" ]; then
    export MILLSTREAM_COMMIT; MILLSTREAM_COMMIT=$(cat "$G/commit")
  fi
  PY=python3
  "$PY" bench/gpu_imports.py ${GPU_IMPORTS_SKIP:+--skip "$GPU_IMPORTS_SKIP"} || {
    say "the bundle lacks what the run imports (above): add the wheels to scripts/gpu_wheels.txt,"
    say "make gpu-bundle where there is network, and carry .gpu again"
    exit 2
  }
  # the torch names and keywords millstream uses, against the image's torch: named, never fatal
  "$PY" bench/gpu_api.py || say "the torch API scan itself failed (above); going on"
  redis-server --version >/dev/null || { say "the carried redis-server does not run here"; exit 2; }
else
  PY=${PY:-}
  [ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
  [ -x .venv/bin/millstream ] && export MILLSTREAM=${MILLSTREAM:-$PWD/.venv/bin/millstream}
fi
export PYTHONUNBUFFERED=1
"$PY" -c 'import millstream.cli' 2>/dev/null || {
  say "$PY cannot import millstream: make gpu-bundle where there is network and carry .gpu/,"
  say "or pip install -e '.[all]' into the Python with CUDA torch (it keeps that torch)"
  exit 2
}
command -v redis-server >/dev/null || { say "no redis-server on PATH (apt-get install redis-server)"; exit 2; }
say "set up in $((SECONDS - start)) s with $("$PY" --version 2>&1)"
exec "$PY" bench/gpu_check.py "$@"
