"""The RL objective, separate from any backend: advantages (per estimator) and the loss.

Backends (torch, FSDP2, Megatron) compute logprobs and call these unchanged, so all give
the same loss on the same batch.
"""
