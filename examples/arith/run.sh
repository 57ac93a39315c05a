#!/usr/bin/env bash
# The main job (`make run`): GRPO on two-digit addition with a 140k-parameter Qwen2, on CPU.
# Written as a Miles launch script: bash arrays of Miles flags, then one command.
# Everything it needs ships in this folder (model/, data/); `millstream train-async` starts a
# private redis-server, the engine, the router and the workers, and stops them at the end;
# then `millstream plot` draws the run's curves into $RUN_DIR/plots/.
# MODE=train-async (default: one version of overlap; a sync updates the engines in place)
# or MODE=train (strictly on-policy). On the 2-core CPU machine async reaches 85% greedy
# accuracy first (7.2 s vs 9.7 s) and at 3586 vs 2645 completions/s (README), so it is the
# default.
# On a machine with a GPU (COLOCATE=auto, the default) the trainer and the engine share it,
# taking turns (--colocate, docs/gpus.md), and the trainer steps in bf16 with fp32
# masters (--bf16); COLOCATE=0 keeps the flags as written.
# Extra flags after the script's name go last, so they win (compose passes --redis-url,
# --router-url and --coordinator-port: the trainer then joins the running services).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MILLSTREAM="${MILLSTREAM:-$ROOT/.venv/bin/millstream}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/arith}"

CKPT_ARGS=(
   --hf-checkpoint "$HERE/model"
   --save "$RUN_DIR/ckpt"
   --save-interval 50
)

ROLLOUT_ARGS=(
   --prompt-data "$HERE/data/train.jsonl"
   --input-key prompt
   --label-key label
   --rollout-shuffle
   --rm-type exact
   --num-rollout "${NUM_ROLLOUT:-90}"
   --rollout-batch-size 64
   --n-samples-per-prompt 8
   --global-batch-size 512
   --rollout-max-response-len 4
   --rollout-temperature 1.0
   --rollout-skip-special-tokens
)

EVAL_ARGS=(
   --eval-interval 5
   --eval-prompt-data arith "$HERE/data/eval.jsonl"
   --n-samples-per-eval-prompt 1
   --eval-temperature 0
   --eval-max-response-len 4
)

PERF_ARGS=(
   --micro-batch-size 512
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --eps-clip 0.2
   --eps-clip-high 0.28
   --use-tis
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 5e-4
   --lr-decay-style constant
   --weight-decay 0.0
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-engines 1
   --engine-max-running-requests 128
)

SERVICE_ARGS=(
   --run-id arith
   --run-dir "$RUN_DIR"
   --num-rollout-workers 2
   --num-reward-workers 1
   --rollout-max-concurrency 128
   --log-level warning
)

# RUN_DIR is never emptied: an earlier run's files (metrics, summary, checkpoints) are kept.
# A run told to resume (--load among the extra flags: a restarted trainer,
# tests/chaos/monkey.py) uses it as it is. A fresh start finds there either nothing, or a run
# that finished (its summary.json says so: started again, by a second `docker compose up` say,
# this says so and exits 0, before anything starts), or anything else, an unfinished run's
# checkpoints included, which is moved aside whole to $RUN_DIR.prev-<time> (below) and the new
# run starts empty. RERUN=1 runs a finished run again, its files moved aside the same way.
FRESH=1
[[ " $* " == *" --load "* || " $* " == *" --load="* ]] && FRESH=0
SUMMARY="$RUN_DIR/summary.json"
ENDED="$(sed -n 's/.*"ended": *"\([^"]*\)".*/\1/p' "$SUMMARY" 2>/dev/null | head -1)" || ENDED=""
if [ "$FRESH" = 1 ] && [ "$ENDED" = finished ] && [[ "${RERUN:-0}" =~ ^0?$ ]]; then
   echo "[run.sh] the run in $RUN_DIR finished at $(date -r "$SUMMARY" '+%F %T %Z')" \
      "(summary: $SUMMARY): not run again. RERUN=1 runs it again (its files moved to" \
      "$RUN_DIR.prev-<time> first); another RUN_DIR (compose: RUN_ID) starts a new run" >&2
   exit 0
fi

# One GPU: colocate, as Miles does when GPUs are scarce (not when the engines run elsewhere).
# `millstream gpus` answers with the torch the trainer will import, whatever $MILLSTREAM is (a
# venv's script, a `python3 -m millstream.cli` wrapper, a command on PATH); the decision is
# printed either way.
if [ "${COLOCATE:-auto}" = 0 ]; then
   echo "[run.sh] COLOCATE=0: the flags as written" >&2
elif [[ " $* " == *" --router-url "* || " $* " == *" --router-url="* ]]; then
   echo "[run.sh] --router-url: the engines run elsewhere; the flags as written" >&2
else
   ASKED=0
   GPUS="$("$MILLSTREAM" gpus)" || ASKED=$?  # its errors go to our stderr
   GPUS="${GPUS%%$'\n'*}"
   if [ "$ASKED" != 0 ] || ! [[ "$GPUS" =~ ^[0-9]+$ ]]; then
      echo "[run.sh] '$MILLSTREAM gpus' gave no GPU count (exit $ASKED, first line" \
         "'${GPUS:0:120}'): CPU run" >&2
   elif [ "$GPUS" -gt 0 ]; then
      PERF_ARGS+=(--colocate --bf16)
      echo "[run.sh] $GPUS GPU(s) visible to $MILLSTREAM: --colocate --bf16 (COLOCATE=0 to" \
         "run as written)" >&2
   else
      echo "[run.sh] no GPU visible to $MILLSTREAM: CPU run" >&2
   fi
fi

MODE="${MODE:-train-async}"
case "$MODE" in
   train) ;;
   train-async) SERVICE_ARGS+=(--max-staleness 1 --pause-mode in_place) ;;
   *) echo "MODE must be train or train-async (got $MODE)" >&2; exit 2 ;;
esac
echo "[run.sh] millstream $MODE (set MODE=train or MODE=train-async; train-async is the" \
    "default: on the 2-core machine it reached 85% first, 7.2 s vs 9.7 s, README)" >&2

if [ "$FRESH" = 1 ] && [ -n "$(ls -A "$RUN_DIR" 2>/dev/null)" ]; then
   PREV="$RUN_DIR.prev-$(date '+%Y%m%d-%H%M%S')"
   [ ! -e "$PREV" ] || PREV="$PREV-$$"
   if ! mv -T "$RUN_DIR" "$PREV"; then
      echo "[run.sh] $RUN_DIR holds an earlier run and cannot be moved aside to $PREV:" \
         "move it yourself, or set another RUN_DIR" >&2
      exit 1
   fi
   echo "[run.sh] $RUN_DIR held an earlier run (${ENDED:+ended: }${ENDED:-no summary.json}):" \
      "moved to $PREV (--load $PREV/ckpt resumes from its checkpoints); a fresh run starts" >&2
fi
# Not `exec`: the plots come after training. The trainer stops cleanly on SIGTERM, and in
# compose this shell is PID 1, which `docker stop` signals: so TERM and INT go on to it.
"$MILLSTREAM" "$MODE" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${EVAL_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${SERVICE_ARGS[@]}" \
   "$@" &
TRAINER=$!
trap 'kill -TERM "$TRAINER" 2>/dev/null || true' TERM INT
STATUS=0
wait "$TRAINER" || STATUS=$?
# A signal ends `wait` before the trainer has stopped: wait on until it has.
while kill -0 "$TRAINER" 2>/dev/null; do STATUS=0; wait "$TRAINER" || STATUS=$?; done
trap - TERM INT
[ "$STATUS" -eq 0 ] || exit "$STATUS"

# The job is the training: a plot that fails says why and leaves the exit status at 0.
# On stderr, with run.sh's own lines: stdout is the trainer's.
if "$MILLSTREAM" plot "$RUN_DIR" >&2; then
   echo "[run.sh] plots in $RUN_DIR/plots/" >&2
fi
