#!/usr/bin/env bash
# A Miles launch script for one 4-GPU node, in the shape Miles' docs give for placement: two
# trainer ranks on GPUs 0-1 (--actor-num-gpus-per-node 2, under torchrun), and the engines on
# --rollout-num-gpus 2 more, --rollout-num-gpus-per-engine 2 each (one SGLang server, TP 2, on
# GPUs 2-3), with SGLang's own settings in SGLANG_ARGS as --sglang-* flags (handed to
# sglang.launch_server as --mem-fraction-static, --cuda-graph-max-bs-decode, ...). `millstream plan
# --gpus 4 <these flags>` prints that plan on any machine (docs/gpus.md, "Placement").
# On the node: torchrun --nproc-per-node 2 -m millstream.cli train ... (the trainer's ranks),
# with sglang installed (two GPUs per engine need it; millstream's own engine takes one).
# CPU_ONLY=1 runs the same arrays on a machine without GPUs: one trainer rank and the engine
# on the CPU (--rollout-num-gpus 0), which is how `make test` trains it.
# Data and model: examples/arith's, as the other scripts here; change the paths for yours.
# Extra flags after the script's name go last, so they win.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MILLSTREAM="${MILLSTREAM:-$ROOT/.venv/bin/millstream}"
MODEL_DIR="${MODEL_DIR:-$ROOT/examples/arith/model}"
PROMPT_DATA="${PROMPT_DATA:-$ROOT/examples/arith/data/train.jsonl}"
EVAL_DATA="${EVAL_DATA:-$ROOT/examples/arith/data/eval.jsonl}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/miles-gpu-node}"

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

PLACEMENT_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node 2
   --rollout-num-gpus 2
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
   --sglang-cuda-graph-max-bs-decode 64
   --sglang-context-length 64
   --sglang-log-level warning
)

if [ "${CPU_ONLY:-0}" = 1 ]; then
   PLACEMENT_ARGS=(--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 0)
   SGLANG_ARGS+=(--rollout-num-gpus-per-engine 1)
fi

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
   "${PLACEMENT_ARGS[@]}" \
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
