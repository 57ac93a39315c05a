#!/usr/bin/env bash
# On-policy distillation (OPD), the shape of Miles'
# examples/on_policy_distillation/run-qwen3-8B-opd-megatron.sh: GRPO plus the distillation term
# (--use-opd: advantage -= --opd-kl-coef x (student logprob - teacher logprob) per token) with
# the teacher loaded by the trainer (--opd-type megatron --opd-teacher-load, as in Miles;
# --opd-type sglang takes --opd-teacher-url, a running engine that scores the samples,
# instead; a teacher flag that does not match the type exits 2). The teacher must be a Hugging Face
# model dir: a Megatron torch_dist one exits 2 naming --opd-teacher-load and the converter.
# `millstream train`: strictly on-policy. TEACHER_DIR is the teacher (on CPU, by default, the
# tiny model itself: the term is then 0 at the first step, which is enough to show it runs).
# On CPU it trains examples/arith's tiny Qwen2 as it stands; for your own model and data change
# only the paths: MODEL_DIR, TEACHER_DIR, PROMPT_DATA, RUN_DIR (and NUM_ROLLOUT). MODEL_ARGS are
# left out: the torch backend builds the model from MODEL_DIR's config.json. The sizes are the
# arith task's. Extra flags after the script's name go last, so they win.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MILLSTREAM="${MILLSTREAM:-$ROOT/.venv/bin/millstream}"
MODEL_DIR="${MODEL_DIR:-$ROOT/examples/arith/model}"
TEACHER_DIR="${TEACHER_DIR:-$MODEL_DIR}"
PROMPT_DATA="${PROMPT_DATA:-$ROOT/examples/arith/data/train.jsonl}"
RUN_DIR="${RUN_DIR:-$ROOT/runs/miles-opd}"

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
   --use-opd
   --opd-type megatron
   --opd-kl-coef 1.0
   --opd-teacher-load "$TEACHER_DIR"
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
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
   "${SGLANG_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "${SERVICE_ARGS[@]}" \
   "$@"
