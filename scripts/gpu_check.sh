#!/usr/bin/env bash
# `make gpu-check` (bench/gpu_check.py): every GPU path once on one NVIDIA GPU, one table.
# Set-up from what the machine has, in this order:
#   1. .gpu/ (made by scripts/gpu_bundle.sh where there is network, carried to a GPU machine
#      that has none), when no $PY is given and python3 is the Python it was made for: its
#      wheels go to /tmp/millstream-site once, `import millstream` resolves to this
#      checkout's services/, redis-server and a `millstream` command from .gpu/bin;
#   2. else $PY, else .venv/bin/python, else python3: it must import millstream already
#      (pip install -e '.[all]' into a Python that has CUDA torch keeps that torch).
# Arguments go to bench/gpu_check.py (--device cpu --small: the plumbing without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[gpu-check] %s\n' "$*" >&2; }
start=$SECONDS

BUNDLE_PY=$(cat .gpu/python-version 2>/dev/null || true)
if [ -z "${PY:-}" ] && [ -d .gpu/whl ] && [ -n "$BUNDLE_PY" ] \
   && python3 -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$BUNDLE_PY')"; then
  G=$PWD/.gpu
  SITE=/tmp/millstream-site
  stamp="$SITE/.done-$(ls "$G/whl" | cksum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ]; then
    say "installing the carried wheels into $SITE"
    rm -rf "$SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$SITE" "$G"/whl/*.whl
    touch "$stamp"
  fi
  mkdir -p /tmp/millstream-pkg
  ln -sfn "$PWD/services" /tmp/millstream-pkg/millstream
  export PYTHONPATH="/tmp/millstream-pkg:$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$G/bin:$PATH" MILLSTREAM="$G/bin/millstream"
  PY=python3
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
