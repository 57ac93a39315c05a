#!/usr/bin/env bash
# What a compose build needs, made once (idempotent; `make compose-up` and `make compose-test`
# both run it):
#   deploy/compose/prepare.sh          all three steps
#   deploy/compose/prepare.sh env      only step 1
#   1. deploy/compose/.env when missing: a random REDIS_PASSWORD and ADMIN_TOKEN,
#      COMPOSE_PROFILES=cpu.
#   2. the base image every image here is built FROM, recorded as BASE_IMAGE in .env: the one
#      set there (or in the environment) if it is present or pulls; else python:3.11-slim if
#      present or pulled within PULL_TIMEOUT seconds (default 60); else, with no registry,
#      millstream-base:bookworm from Debian's packages (base-image.sh: debootstrap, which this
#      installs when missing).
#   3. the host's pip settings as build inputs: the wheels in its find-links (torch's CPU build
#      among them: the image then installs torch with no index at all) into wheels/, and the
#      CA bundle pip trusts into ca/.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
ENV_FILE="$HERE/.env"
say() { printf '[compose] %s\n' "$*"; }
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

token() { head -c 18 /dev/urandom | base64 | tr -d '/+='; }
if [ ! -f "$ENV_FILE" ]; then
  printf 'REDIS_PASSWORD=%s\nADMIN_TOKEN=%s\nCOMPOSE_PROFILES=cpu\n' "$(token)" "$(token)" > "$ENV_FILE"
  say "wrote $ENV_FILE (a random REDIS_PASSWORD and ADMIN_TOKEN; COMPOSE_PROFILES=cpu)"
fi
[ "${1:-all}" = env ] && exit 0

# -- 2. the base image -------------------------------------------------------------------------
DEBIAN_BASE=millstream-base:bookworm
have() { docker image inspect "$1" >/dev/null 2>&1; }
pulls() { say "pulling $1 (at most ${PULL_TIMEOUT:-60} s)"; timeout "${PULL_TIMEOUT:-60}" docker pull -q "$1" >/dev/null 2>&1; }
debian_base() {
  if ! command -v debootstrap >/dev/null; then
    say "installing Debian's debootstrap"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq debootstrap >/dev/null
  fi
  $SUDO bash "$HERE/base-image.sh" "$DEBIAN_BASE"
}
docker info >/dev/null 2>&1 || { say "no Docker daemon answers (docker info): start dockerd first (Debian: apt-get install docker.io, then systemctl start docker, or dockerd > /tmp/dockerd.log 2>&1 &; docs/operations.md)"; exit 1; }
BASE="${BASE_IMAGE:-$(sed -n 's/^BASE_IMAGE=//p' "$ENV_FILE" | tail -1)}"
if [ -n "$BASE" ]; then
  if [ "$BASE" = "$DEBIAN_BASE" ]; then
    have "$BASE" || debian_base
  elif ! have "$BASE" && ! pulls "$BASE"; then
    say "BASE_IMAGE=$BASE is neither here nor pullable: build one from Debian's packages with"
    say "  $HERE/base-image.sh $DEBIAN_BASE   and set BASE_IMAGE=$DEBIAN_BASE in $ENV_FILE"
    exit 1
  fi
elif have python:3.11-slim || pulls python:3.11-slim; then
  BASE=python:3.11-slim
else
  say "no registry answers: building $DEBIAN_BASE from Debian's packages"
  BASE="$DEBIAN_BASE"
  debian_base
fi
if ! grep -qx "BASE_IMAGE=$BASE" "$ENV_FILE"; then
  sed -i '/^BASE_IMAGE=/d' "$ENV_FILE"
  echo "BASE_IMAGE=$BASE" >> "$ENV_FILE"
  say "base image $BASE (recorded in $ENV_FILE)"
fi

# -- 3. the host's pip settings as build inputs ------------------------------------------------
PIP=("$ROOT/.venv/bin/python" -m pip)
[ -x "$ROOT/.venv/bin/python" ] || PIP=(python3 -m pip)
FIND_LINKS="$("${PIP[@]}" config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}"
for dir in $FIND_LINKS; do
  [ -d "$dir" ] || continue
  for wheel in "$dir"/*.whl; do
    [ -f "$wheel" ] && [ ! -f "$HERE/wheels/${wheel##*/}" ] || continue
    ln "$wheel" "$HERE/wheels/" 2>/dev/null || cp "$wheel" "$HERE/wheels/"
    say "build input: ${wheel##*/}"
  done
done
CERT="$("${PIP[@]}" config get global.cert 2>/dev/null || echo "${PIP_CERT:-}")"
if [ -n "$CERT" ] && [ -f "$CERT" ] && ! cmp -s "$CERT" "$HERE/ca/host.crt"; then
  cp "$CERT" "$HERE/ca/host.crt"
  say "build input: pip's CA bundle $CERT"
fi
