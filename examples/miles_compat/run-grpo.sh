#!/usr/bin/env bash
# Dense GRPO, the shape of Miles' scripts/run-qwen3-4B.sh: GRPO advantages, the KL to the
# reference kept as a logged signal (--kl-loss-coef 0.00), clip-higher (--eps-clip-high), one
# optimizer step per rollout. `millstream train`: strictly on-policy, as Miles' train.py.
# On CPU it trains examples/arith's tiny Qwen2 on two-digit addition as it stands; for your
# own model and data change only the paths: MODEL_DIR, PROMPT_DATA, EVAL_DATA, RUN_DIR (and
# NUM_ROLLOUT, the run's length). MODEL_ARGS are left out: the torch backend builds the model
# from MODEL_DIR's config.json (Megatron's flags, given, must match it). The batch sizes and
# lengths are the arith task's; a real model takes Miles' (run-qwen3-4B.sh).
# Extra flags after the script's name go last, so they win.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MILLSTREAM="${MILLSTREAM:-$ROOT/.venv/bin/millstream}"
MODEL_DIR="${MODEL_DIR:-$ROOT/examples/arith/model}"
PROMPT_DATA="${PROMPT_DATA:-$ROOT/examples/arith/data/train.jsonl}"
EVAL_DATA="${EVAL_DATA:-$ROOT/examples/arith/data/eval.jsonl}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/miles-grpo}"

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

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data arith "$EVAL_DATA"
   --n-samples-per-eval-prompt 1
   --eval-temperature 0
   --eval-max-response-len 4
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
   --num-rollout-workers 1
   --num-reward-workers 1
   --log-level warning
)

exec "$MILLSTREAM" train \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node 1 \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${EVAL_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${SERVICE_ARGS[@]}" \
   "$@"
