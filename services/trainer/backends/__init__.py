"""The train step: the same batch in, the same loss out, on any backend (docs/backends.md).

Owns `TrainBackend` (base.py) and its two builds, siblings on one step loop (loop.py
`StepLoop`, with its forwards.py and saving.py): `torch_backend` (a Hugging Face model as the
actor, the shared-prompt layout, FSDP2) and `megatron/` (megatron-core's GPTModel, TP/PP/CP).
The components both use: `optim` (the optimizer and its learning-rate schedule), `rows` (a
micro-batch's layout: padded, packed or with shared prompts), `shared_prefix` (the
shared-prompt layout's rows and mask), `batching` (micro-batches and rank shards), `critic`
(PPO's value model), `precision` (--bf16's fp32 masters), `chunked` (--log-probs-chunk-size),
`distributed` (data parallel ranks under torchrun) and `offload` (--offload-train). All of
them call `trainer.algorithms` for the loss.
"""
