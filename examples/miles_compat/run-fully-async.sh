#!/usr/bin/env bash
# Fully async, the shape of Miles' examples/fully_async/run-qwen3-4b-fully_async.sh: rollout
# never waits for training. Miles asks for it with train_async.py and --fully-async (a
# background rollout worker, --max-weight-staleness for staleness control); here that is
# `millstream train-async`, whose rollout workers keep generating while the trainer trains,
# between weight syncs (--fully-async is accepted and says so; with `millstream train` it runs
# train-async): --max-staleness 2 lets work run two policy versions ahead,
# --max-weight-staleness 2 drops (and counts) samples older than that, and --pause-mode
# in_place pauses the engines for a weight sync with their batches and KV cache kept, to go on
# after it, instead of aborting them. TIS corrects the off-policy samples (--use-tis).
# On CPU it trains examples/arith's tiny Qwen2 as it stands; for your own model and data change
# only the paths: MODEL_DIR, PROMPT_DATA, RUN_DIR (and NUM_ROLLOUT). MODEL_ARGS are
# left out: the torch backend builds the model from MODEL_DIR's config.json. The sizes are the
# arith task's. Extra flags after the script's name go last, so they win.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MILLSTREAM="${MILLSTREAM:-$ROOT/.venv/bin/millstream}"
MODEL_DIR="${MODEL_DIR:-$ROOT/examples/arith/model}"
PROMPT_DATA="${PROMPT_DATA:-$ROOT/examples/arith/data/train.jsonl}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/miles-fully-async}"

CKPT_ARGS=(
   --hf-checkpoint "$MODEL_DIR"
   --load "$RUN_DIR/ckpt"
   --save "$RUN_DIR/ckpt"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "$PROMPT_DATA"
   --input-key prompt
   --label-key label
   --rollout-shuffle
   --rm-type exact
   --num-rollout "${NUM_ROLLOUT:-40}"
   --rollout-batch-size 8
   --n-samples-per-prompt 8
   --rollout-max-response-len 4
   --rollout-temperature 1
   --rollout-skip-special-tokens
   --global-batch-size 64
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --micro-batch-size 64
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
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
   --rollout-num-gpus-per-engine 1
   --rollout-num-engines 1
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
)

SERVICE_ARGS=(
   --run-dir "$RUN_DIR"
   --fully-async
   --num-rollout-workers 1
   --num-reward-workers 1
   --max-staleness 2
   --max-weight-staleness 2
   --pause-mode in_place
   --log-level warning
)

exec "$MILLSTREAM" train-async \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${SERVICE_ARGS[@]}" \
   "$@"
