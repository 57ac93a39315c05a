#!/usr/bin/env bash
# `make swarm-test`: the arith example as a Docker Swarm stack (deploy/swarm/stack.yml), for real,
# on this one machine.
#   1. dockerd (Debian's docker.io) and the millstream image, built as `make compose-up` builds
#      it (deploy/compose/prepare.sh, then compose's build: a base image from Debian's packages
#      when no registry answers, the host's local wheels and CA bundle; the build's cache makes
#      a rebuild after a source edit a matter of seconds);
#   2. `docker swarm init` (unless this node is in a swarm already), labels this node for the
#      trainer and engines, makes the two secrets;
#   3. `docker stack deploy` (nothing orders the start: each service waits for what it needs),
#      and only REDIS_LATE_S (20) later the label that lets Redis start here: the trainer waits;
#      at iteration 3, `docker service scale rollout=3 engine=2`, and checks that the new
#      replicas joined (3 rollout heartbeats in Redis, 2 engines at the router);
#   4. waits for the trainer's task to complete, and checks: exit code 0, it waited for Redis,
#      Swarm did not start it again (one task, still complete 15 s later), admitted == terminal
#      states, every engine at the final version; prints a table;
#   5. always: `docker stack rm`, the volumes and secrets removed, and the swarm left if this
#      script made it.
# Not part of `make test`: it needs a Docker daemon and minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
HERE="$ROOT/deploy/swarm"
say() { printf '[swarm-test] %s\n' "$*"; }
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
STACK="${STACK:-millstream-swarm}"
export MILLSTREAM_IMAGE="${MILLSTREAM_IMAGE:-millstream:latest}"
export NUM_ROLLOUT="${NUM_ROLLOUT:-30}" MODE="${MODE:-train}" RUN_ID="${RUN_ID:-arith}"
export REDIS_PASSWORD_SECRET="${STACK}_redis_password" ADMIN_TOKEN_SECRET="${STACK}_admin_token"

bash scripts/bootstrap.sh >/dev/null
if ! command -v dockerd >/dev/null; then
  say "installing Debian's docker.io"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker.io >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log /tmp/millstream-dockerd.log)"
  ($SUDO dockerd >/tmp/millstream-dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start; see /tmp/millstream-dockerd.log"; exit 1; }
fi

# -- 1. the image: compose's build (deploy/compose/), which Swarm cannot do ------------------
START=$(date +%s)
bash deploy/compose/prepare.sh  # .env, the base image, local wheels and CA bundle
say "building $MILLSTREAM_IMAGE with compose's build (base $(sed -n 's/^BASE_IMAGE=//p' deploy/compose/.env))"
COMPOSE_PROJECT_NAME="$STACK-build" COMPOSE_PROFILES=cpu bash deploy/compose/compose.sh build trainer
BUILT=$(date +%s)

# -- 2. a swarm of one, its labels and secrets ---------------------------------------------
INITED=0
if [ "$(docker info -f '{{.Swarm.LocalNodeState}}')" != active ]; then
  say "docker swarm init"
  if ! docker swarm init >/dev/null 2>&1; then
    docker swarm init --advertise-addr "$(hostname -I | awk '{print $1}')" >/dev/null
  fi
  INITED=1
fi
NODE="$(docker info -f '{{.Swarm.NodeID}}')"
LABELS=(millstream.redis millstream.trainer millstream.engine)

DEPLOYED=0
cleanup() {
  set +e
  if [ "$DEPLOYED" = 1 ]; then
    docker service logs --no-task-ids "${STACK}_trainer" > /tmp/millstream-swarm-trainer.log 2>&1
    say "docker stack rm $STACK"
    docker stack rm "$STACK" >/dev/null 2>&1
    # The volumes and the network go once the stack's containers have.
    for _ in $(seq 60); do
      [ -z "$(docker ps -aq --filter "label=com.docker.stack.namespace=$STACK")" ] \
        && ! docker network inspect "${STACK}_millstream" >/dev/null 2>&1 && break
      sleep 1
    done
    docker volume rm "${STACK}_runs" "${STACK}_redis-data" >/dev/null 2>&1
  fi
  docker secret rm "$REDIS_PASSWORD_SECRET" "$ADMIN_TOKEN_SECRET" >/dev/null 2>&1
  if [ "$INITED" = 1 ]; then
    say "docker swarm leave --force (this script made the swarm)"
    docker swarm leave --force >/dev/null 2>&1
  else
    docker node update $(printf -- '--label-rm %s ' "${LABELS[@]}") "$NODE" >/dev/null 2>&1
  fi
}
trap cleanup EXIT

# Redis's label comes REDIS_LATE_S after the deploy: until then its task has no node, and the
# trainer and workers must wait for it (the issue's trainer crash-looped instead).
docker node update --label-rm millstream.redis "$NODE" >/dev/null 2>&1 || true
docker node update --label-add millstream.trainer=true --label-add millstream.engine=true "$NODE" >/dev/null
docker secret rm "$REDIS_PASSWORD_SECRET" "$ADMIN_TOKEN_SECRET" >/dev/null 2>&1 || true
REDIS_PASSWORD="$(head -c 18 /dev/urandom | base64 | tr -d '/+=\n')"
printf %s "$REDIS_PASSWORD" | docker secret create "$REDIS_PASSWORD_SECRET" - >/dev/null
head -c 18 /dev/urandom | base64 | tr -d '/+=\n' | docker secret create "$ADMIN_TOKEN_SECRET" - >/dev/null

# -- 3. deploy, scale mid-run, check the new replicas joined -------------------------------
say "docker stack deploy $STACK (NUM_ROLLOUT=$NUM_ROLLOUT MODE=$MODE)"
DEPLOYED=1
docker stack deploy --resolve-image never -c "$HERE/stack.yml" "$STACK" >/dev/null
trainer_log() { docker service logs --raw "${STACK}_trainer" 2>&1; }
sleep "${REDIS_LATE_S:-20}"
say "labelling this node millstream.redis: Redis starts now"
docker node update --label-add millstream.redis=true "$NODE" >/dev/null
for _ in $(seq 900); do trainer_log | grep -q "iter 3/" && break; sleep 1; done
trainer_log | grep -q "iter 3/" || { trainer_log | tail -30; say "the trainer never reached iteration 3"; exit 1; }
UP=$(date +%s)
say "mid-run: docker service scale rollout=3 engine=2"
docker service scale --detach "${STACK}_rollout=3" "${STACK}_engine=2" >/dev/null

# A one-off container on the stack's network (attachable), its runs volume mounted: what a
# service sees, read by a Python script on stdin.
probe() {
  docker run --rm -i --network "${STACK}_millstream" -v "${STACK}_runs:/runs:ro" \
    -e REDIS_PASSWORD="$REDIS_PASSWORD" -e RUN_ID="$RUN_ID" "$MILLSTREAM_IMAGE" python3 -
}
JOINED=$(probe <<'PY'
import json, os, time, urllib.request
import redis
r = redis.Redis(host="redis", password=os.environ["REDIS_PASSWORD"])
deadline, seen = time.monotonic() + 180, {}
while time.monotonic() < deadline:
    seen["rollout"] = len(list(r.scan_iter(f"{os.environ['RUN_ID']}:workers:rollout:*")))
    seen["engines"] = len(json.load(urllib.request.urlopen("http://router:30000/list_workers"))["urls"])
    if seen["rollout"] >= 3 and seen["engines"] >= 2:
        break
    time.sleep(1)
print(json.dumps(seen))
PY
)
say "joined after the scale: $JOINED"

# -- 4. the trainer runs to its end, once ---------------------------------------------------
task_states() { docker service ps --no-trunc --format '{{.CurrentState}}' "${STACK}_trainer"; }
for _ in $(seq 900); do
  task_states | grep -Eq '^(Complete|Failed|Rejected|Shutdown)' && break; sleep 1
done
DONE=$(date +%s)
TASK="$(docker service ps -q --no-trunc "${STACK}_trainer" | head -1)"
CODE="$(docker inspect --type task -f '{{.Status.ContainerStatus.ExitCode}}' "$TASK" 2>/dev/null || echo '?')"
sleep 15  # time for Swarm to start it again, were it to
TASKS="$(docker service ps -q "${STACK}_trainer" | wc -l)"
STATE="$(task_states | head -1 | awk '{print $1}')"
trainer_log | grep "\[trainer\]" | tail -3 || true
WAITED="$(trainer_log | grep -c 'Redis at .* unreachable for' || true)"

CHECK=$(probe <<'PY'
import json, os, urllib.request
summary = json.load(open(f"/runs/{os.environ['RUN_ID']}/summary.json"))
c = summary["counts"]
terminal = c["trained"] + c["filtered"] + c["failed"] + c["dropped_stale"] + c["dropped_at_end"]
engines = json.load(urllib.request.urlopen("http://router:30000/list_workers"))["urls"]
versions = [json.load(urllib.request.urlopen(u + "/get_weight_version"))["weight_version"] for u in engines]
print(json.dumps({"admitted": c["admitted"], "terminal": terminal, "ended": summary["ended"],
                  "engines": len(engines), "versions": versions}))
PY
)
say "result: $CHECK"
python3 - "$CHECK" "$JOINED" "$CODE" "$TASKS" "$STATE" "$NUM_ROLLOUT" \
  "$((BUILT - START))" "$((UP - BUILT))" "$((DONE - UP))" "$WAITED" <<'PY'
import json, sys
r, joined = json.loads(sys.argv[1]), json.loads(sys.argv[2])
code, tasks, state, n = sys.argv[3].strip(), sys.argv[4].strip(), sys.argv[5], sys.argv[6]
build_s, up_s, run_s, waited = sys.argv[7:11]
rows = [
    ("trainer exit code", code, code == "0"),
    ("trainer waited for Redis (its lines)", waited, int(waited) > 0),
    ("trainer tasks (not started again)", f"{tasks}, {state}", tasks == "1" and state == "Complete"),
    ("scaled replicas joined", f"rollout {joined['rollout']}, engines {joined['engines']}",
     joined["rollout"] >= 3 and joined["engines"] >= 2),
    ("admitted == terminal states", f"{r['admitted']} == {r['terminal']}", r["admitted"] == r["terminal"]),
    ("engines at the final version", f"{r['engines']}: {r['versions']}",
     r["engines"] >= 2 and set(r["versions"]) == {n}),
]
print("| swarm-test check | value | ok |\n|---|---|---|")
for name, value, ok in rows:
    print(f"| {name} | {value} | {'yes' if ok else 'NO'} |")
print(f"build {build_s} s, deploy to iteration 3 {up_s} s, then to the end {run_s} s")
sys.exit(0 if all(ok for *_, ok in rows) else 1)
PY
