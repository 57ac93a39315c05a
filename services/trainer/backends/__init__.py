"""Trainer backends: the same batch in, the same loss out (DESIGN.md section 6).

`torch` (default on CPU): a Hugging Face causal LM and a torch optimizer. A Megatron backend
will implement the same `TrainBackend` protocol and reuse `millstream.trainer.algorithms`.
"""
