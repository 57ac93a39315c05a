#!/usr/bin/env bash
# DAPO, the shape of Miles' DAPO recipes (scripts/run-moonlight-16B-A3B.sh and the other
# dapo-math scripts): dynamic sampling (--over-sampling-batch-size prompts admitted per refill,
# groups whose rewards all agree dropped by Miles' check_reward_nonzero_std filter, refilled
# until --rollout-batch-size groups pass), clip-higher (--eps-clip-high 0.28), token-level loss
# (--calculate-per-token-loss), and partial rollout: samples cut off by a weight sync resume
# from their tokens (--partial-rollout, the resumed prefix masked out of the loss). Runs under
# `millstream train-async` (Miles' train_async.py): rollout overlaps training by one version.
# On CPU it trains examples/arith's tiny Qwen2 as it stands; for your own model and data change
# only the paths: MODEL_DIR, PROMPT_DATA, RUN_DIR (and NUM_ROLLOUT). MODEL_ARGS are left out:
# the torch backend builds the model from MODEL_DIR's config.json. The sizes are the arith
# task's. Extra flags after the script's name go last, so they win.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MILLSTREAM="${MILLSTREAM:-$ROOT/.venv/bin/millstream}"
MODEL_DIR="${MODEL_DIR:-$ROOT/examples/arith/model}"
PROMPT_DATA="${PROMPT_DATA:-$ROOT/examples/arith/data/train.jsonl}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/miles-dapo}"

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

   --over-sampling-batch-size 16
   --dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
   --partial-rollout
   --mask-offpolicy-in-partial-rollout

   --num-steps-per-rollout 1
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --micro-batch-size 64
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --kl-loss-coef 0.00
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
   --calculate-per-token-loss
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

SERVICE_ARGS=(
   --run-dir "$RUN_DIR"
   --num-rollout-workers 1
   --num-reward-workers 1
   --max-staleness 1
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
   "${SERVICE_ARGS[@]}" \
   "$@"
