"""Every budget of the KV token pool: what one token costs, and how many tokens the pool gets.

`pool_size` is the one place --max-total-tokens and --mem-fraction-static become a pool size
(core.py passes them in; token_pool.py allocates what it says, in whole pages):

  - on a GPU the pool is allocated once at its full size: --max-total-tokens, else
    `kv_token_budget`, what --mem-fraction-static leaves after the weights (below);
  - on the CPU it starts at CPU_START_TOKENS and doubles as steps need, up to
    --max-total-tokens, else `host_token_budget`: CPU_MEMORY_SHARE of the host's available
    memory. A laptop does not pay for a pool it never fills.

KV budget on a GPU (`kv_tokens_for`): SGLang's ModelRunner.profile_max_num_token. After the
weights are loaded, with F = --mem-fraction-static (DEFAULT_MEM_FRACTION unless given),
    rest   = free_after_weights - total x (1 - F)
    tokens = rest // bytes_per_token          (keys and values of every layer)
so total x (1 - F) of the GPU stays free for activations, CUDA graphs and the sampling
buffers, whatever else (a colocated trainer) holds memory; too little free is an error naming
--mem-fraction-static, never an OOM later while capturing. SGLang's `total` is the memory
free before loading the weights; the device's total is used here, which keeps at least as
much free.

This module imports no torch when it loads (config.py reads DEFAULT_MEM_FRACTION from it, and
`millstream engine --help` stays light): a dtype's size is its `itemsize`, and only
`kv_token_budget` asks the GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from millstream.common.errors import MillstreamError

if TYPE_CHECKING:
    import torch

DEFAULT_MEM_FRACTION = 0.85  # SGLang's --mem-fraction-static default on a GPU
CPU_START_TOKENS = 4096  # the CPU pool's first size; it doubles as steps need
CPU_MEMORY_SHARE = 0.25  # of the host's available memory: the CPU pool's limit by default


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a Hugging Face decoder config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes one token takes in the KV cache: keys and values of every layer."""
    layers, heads, head_dim = kv_shape(config)
    return 2 * layers * heads * head_dim * dtype.itemsize


def kv_tokens_for(
    total: int, free_after_weights: int, mem_fraction: float, bytes_per_token: int
) -> int:
    """Tokens of KV cache SGLang's --mem-fraction-static allows (module docstring): what is
    free after the weights, less `total x (1 - mem_fraction)` kept free for activations and
    CUDA graphs. Memory in bytes."""
    keep_free = int(total * (1 - mem_fraction))
    rest = free_after_weights - keep_free
    if rest < bytes_per_token:
        gib = 2**30
        raise MillstreamError(
            f"--mem-fraction-static {mem_fraction}: {free_after_weights / gib:.2f} GiB of the "
            f"GPU's {total / gib:.2f} GiB are free after loading the weights, and "
            f"{keep_free / gib:.2f} GiB (1 - {mem_fraction} of it) must stay free for "
            "activations and CUDA graphs, which leaves nothing for the KV cache; raise "
            "--mem-fraction-static, or free the GPU (another process, e.g. a colocated "
            "trainer, may hold memory: see nvidia-smi)"
        )
    return rest // bytes_per_token


def kv_token_budget(
    config: Any, dtype: torch.dtype, device: torch.device, mem_fraction: float
) -> int:
    """`kv_tokens_for` on `device` as it is now (the weights loaded): its free memory, as
    SGLang measures it, with this process's cached blocks handed back first."""
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_tokens_for(total, free, mem_fraction, kv_bytes_per_token(config, dtype))


def host_token_budget(bytes_per_token: int) -> int:
    """Tokens of KV that CPU_MEMORY_SHARE of the host's available memory holds."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(CPU_START_TOKENS, int(available * CPU_MEMORY_SHARE) // bytes_per_token)


@dataclass(frozen=True)
class PoolSize:
    """Tokens the pool is allocated with (`capacity`) and may grow to (`limit`: the same on
    a GPU, where it never grows)."""

    capacity: int
    limit: int


def pool_size(
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_total_tokens: int | None = None,
    mem_fraction: float | None = None,
) -> PoolSize:
    """The pool's size SGLang's way (module docstring), for a model of `config` in `dtype`
    on `device`, its weights already loaded."""
    if device.type == "cuda":
        fraction = mem_fraction or DEFAULT_MEM_FRACTION
        tokens = max_total_tokens or kv_token_budget(config, dtype, device, fraction)
        return PoolSize(capacity=tokens, limit=tokens)
    limit = max_total_tokens or host_token_budget(kv_bytes_per_token(config, dtype))
    return PoolSize(capacity=min(limit, CPU_START_TOKENS), limit=limit)
