#!/usr/bin/env bash
# The live SGLang server's venv, for make test's last tier (tests/sglang_live/): sglang 0.5.23 with
# every dependency at the versions of scripts/sglang-live.txt (--no-deps: what was tested is what
# is installed), in a venv of its own, once per machine: ~11 GB and ~4-5 minutes on 2 cores, then
# reused by every checkout. Never the project's .venv: SGLang pins torch 2.14.1 and transformers
# 5.19, the project torch 2.13.0.
#
#   scripts/bootstrap_sglang.sh            install if missing; print the venv's python
#   scripts/bootstrap_sglang.sh --start    start that in the background at the lowest priority
#                                          (make test: beside the main tier), log in
#                                          .venv/sglang-live.log
#   scripts/bootstrap_sglang.sh --wait     wait for a background install; print the python
#
# Where: $MILLSTREAM_SGLANG_VENV, else ${XDG_CACHE_HOME:-~/.cache}/millstream/sglang-live-<hash
# of the pins>. A failed install prints why and exits 1; the tier then skips, saying so.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '[bootstrap-sglang] %s\n' "$*" >&2; }

PINS=scripts/sglang-live.txt
HASH=$(sha256sum "$PINS" | cut -c1-12)
DIR=${MILLSTREAM_SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/millstream/sglang-live-$HASH}
LOG=.venv/sglang-live.log
PIDFILE=.venv/sglang-live.pid
mkdir -p .venv

install() {
  if [ -f "$DIR/.done" ]; then
    return 0
  fi
  mkdir -p "$(dirname "$DIR")"
  # One install at a time per machine: a second checkout waits for the first.
  exec 9>"$DIR.lock"
  flock 9
  if [ -f "$DIR/.done" ]; then
    return 0
  fi
  local python=${SGLANG_LIVE_PYTHON_BIN:-python3.11}
  command -v "$python" >/dev/null || { say "no $python here (the pins are for Python 3.11)"; return 1; }
  say "installing sglang's live server venv into $DIR ($PINS, about 11 GB, 4-5 minutes)"
  rm -rf "$DIR.tmp"
  "$python" -m venv "$DIR.tmp"
  "$DIR.tmp/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-compile \
    -r "$PINS"
  "$DIR.tmp/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("sglang") is None)'
  rm -rf "$DIR"
  mv "$DIR.tmp" "$DIR"
  # A venv's scripts name its folder: the moved one's python is called by its path, never them.
  touch "$DIR/.done"
  say "ready: $DIR"
}

case "${1:-}" in
  --start)
    if [ -f "$DIR/.done" ]; then
      exit 0
    fi
    # At the lowest CPU priority: make test's main tier keeps both cores, and the install (4-5
    # minutes of unpacking) takes what its tests leave idle; it still ends long before the tier.
    (renice -n 19 -p "$BASHPID" >/dev/null 2>&1 || true; install >"$LOG" 2>&1; echo $? >"$LOG.rc") &
    echo $! >"$PIDFILE"
    say "installing in the background (log: $LOG)"
    ;;
  --wait)
    if [ -f "$PIDFILE" ]; then
      pid=$(cat "$PIDFILE")
      while kill -0 "$pid" 2>/dev/null; do sleep 2; done
      rm -f "$PIDFILE"
    fi
    if [ ! -f "$DIR/.done" ]; then
      install >>"$LOG" 2>&1 || { say "install failed: $(tail -3 "$LOG" | tr '\n' ' ')"; exit 1; }
    fi
    echo "$DIR/bin/python"
    ;;
  "")
    install
    echo "$DIR/bin/python"
    ;;
  *)
    say "unknown argument $1 (none, --start or --wait)"
    exit 2
    ;;
esac
