#!/usr/bin/env bash
# Miles' scripts/run-qwen3-4B.sh as of radixark/miles commit 5ed3fd170bfa (2026-08-09, the last
# one whose MODEL_ARGS came from scripts/models/qwen3-4B.sh; the .sh scripts became .py on
# 2026-08-11). Its flag arrays, CKPT_ARGS to MISC_ARGS, are copied byte for byte, comments
# included; MODEL_ARGS is the text of scripts/models/qwen3-4B.sh at that commit, pasted where
# Miles sources it. What changed: Miles' preamble (pkill -9 of sglang, ray and python, set
# -ex, NVLink detection) and its `ray start` + `ray job submit ... python3 train.py` are gone;
# `millstream train-async` takes the same arrays in the same order instead (last lines).
# It needs the model and data paths below and GPUs; tests/unit/common/test_config.py and
# tests/unit/compat/test_miles_compat.py parse it to keep the flags compatible. With the torch
# backend (the one built) preflight refuses it, exit 2 before anything starts, naming
# --tensor-model-parallel-size 2 and the other Megatron, GPU and SGLang server flags it sets
# (tests/unit/repo/test_flags_consumed.py lists them). Past those, with the model at /root/Qwen3-4B,
# its --ref-load /root/Qwen3-4B_torch_dist (read: --use-kl-loss) is refused as a Megatron
# torch_dist checkpoint, with the converter command to run.
# MILLSTREAM_PRINT_ARGS=1 prints the arguments (NUL-separated) instead of running.
set -euo pipefail

MODEL_ARGS=(
   --swiglu
   --num-layers 36
   --hidden-size 2560
   --ffn-hidden-size 9728
   --num-attention-heads 32
   --group-query-attention
   --num-query-groups 8
   --use-rotary-position-embeddings
   --disable-bias-linear
   --normalization "RMSNorm"
   --norm-epsilon 1e-6
   --rotary-base "${MODEL_ARGS_ROTARY_BASE:-1000000}"
   --vocab-size 151936
   --kv-channels 128
   --qk-layernorm
)

CKPT_ARGS=(
   --hf-checkpoint /root/Qwen3-4B
   #--hf-checkpoint /root/Qwen3-4B-FP8
   --ref-load /root/Qwen3-4B_torch_dist
   --load /root/Qwen3-4B_miles/
   --save /root/Qwen3-4B_miles/
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 8192
   --rollout-temperature 1

   --global-batch-size 256
   --balance-data
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl
   --n-samples-per-eval-prompt 16
   --eval-max-response-len 16384
   --eval-top-p 1
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1

   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1

   # --micro-batch-size 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
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
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

WANDB_ARGS=(
   # --use-wandb
   # --wandb-project miles-dev
   # --wandb-group qwen3-4B-test
   # --wandb-key ${WANDB_KEY}
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --sglang-mem-fraction-static 0.7
)

PROMETHEUS_ARGS=(
   # --use-prometheus
   # --prometheus-port 9090
   # --prometheus-run-name "qwen3-4B-exp"
)

MISC_ARGS=(
   # default dropout in megatron is 0.1
   --attention-dropout 0.0
   --hidden-dropout 0.0
   # should be good for model performance
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   # need to comment this when using model with MLA
   --attention-backend flash
)

ALL_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node 8
   --colocate
   "${MODEL_ARGS[@]}"
   "${CKPT_ARGS[@]}"
   "${ROLLOUT_ARGS[@]}"
   "${OPTIMIZER_ARGS[@]}"
   "${GRPO_ARGS[@]}"
   "${WANDB_ARGS[@]}"
   "${PERF_ARGS[@]}"
   "${EVAL_ARGS[@]}"
   "${SGLANG_ARGS[@]}"
   "${PROMETHEUS_ARGS[@]}"
   "${MISC_ARGS[@]}"
)

if [ "${MILLSTREAM_PRINT_ARGS:-0}" = 1 ]; then
  printf '%s\0' "${ALL_ARGS[@]}"
  exit 0
fi
exec millstream train-async "${ALL_ARGS[@]}"
