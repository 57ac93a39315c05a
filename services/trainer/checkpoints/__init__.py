"""Checkpoints: millstream's own `iter_N/` (save, resume: `checkpoint`), Megatron checkpoint
dirs recognised where another format is wanted (`megatron_ckpt`), and `millstream convert`
between Hugging Face and torch_dist (`convert`). A checkpoint is written whole or not at all,
even by a writer SIGKILLed half-way, and what such a writer leaves is cleaned at the next
start (`atomic`).
"""
