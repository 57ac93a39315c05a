"""The RL objective, separate from any backend: advantages (per estimator) and the loss.

Backends (torch now, Megatron later) compute logprobs and call these unchanged, so both give
the same loss on the same batch.
"""
