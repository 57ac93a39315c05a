"""The train step: the same batch in, the same loss out, on any backend (DESIGN.md section 6).

Owns `TrainBackend` (base.py) and its builds: `torch_backend` (a Hugging Face model and a torch
optimizer, the shared-prompt layout, FSDP2), `megatron/` (megatron-core's GPTModel, TP/PP/CP),
`critic` (PPO's value model), `batching` (micro-batches and rank shards), `distributed`
(data parallel ranks under torchrun), `precision` (--bf16's fp32 masters) and `chunked`
(--log-probs-chunk-size). All of them call `trainer.algorithms` for the loss.
"""
