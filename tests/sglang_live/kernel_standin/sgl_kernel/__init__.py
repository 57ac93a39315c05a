"""A stand-in for the `sgl_kernel` package, on the live SGLang server's PYTHONPATH only (tests).

PyPI's `sgl-kernel` (sglang-kernel 0.4.10, which sglang 0.5.23 installs) is a CUDA build: it
does not import without `libcuda.so.1`, and it has none of the `*_cpu` ops that SGLang's CPU
engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`) imports from it. That engine calls two of
them for a dense decoder such as the tests' tiny Qwen2, and falls back to its own
`forward_native` for everything else:

  assign_req_to_token_pool_cpu   sglang/srt/mem_cache/allocation.py: imported at module level
                                 (line 46, `if _is_cpu`), called by
                                 `assign_req_to_token_pool_func` (line 746) for every batch
                                 that prefills or decodes: the new tokens' KV slots written
                                 into each request's row of the req_to_token table;
  copy_all_layer_kv_cache_cpu    sglang/kernels/ops/kvcache/cache_move.py: imported at module
                                 level (line 10), called by `copy_all_layer_kv_cache_func`
                                 (line 191): KV rows copied from slot to slot in every layer.

Both are a few lines of plain torch here. Other modules import further `*_cpu` names at module
level (speculative decoding's `build_tree_kernel_efficient_cpu`, `verify_tree_greedy_cpu`,
...), which the tiny model's server never calls: the module's `__getattr__` gives each such
name a function that raises, naming it, if it ever is. Never shipped, never on millstream's own
path: only tests/sglang_live/ puts this folder on the server's PYTHONPATH.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i of the batch, in order: req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]] = the next end - start entries of out_cache_loc (SGLang's
    Triton kernel `assign_req_to_token_pool`, whose per-request offset is the sum of the
    earlier requests' lengths)."""
    del pool_len  # the row width: req_to_token's own
    at = 0
    rows = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    for row, start, end in zip(rows, starts, ends, strict=True):
        req_to_token[row, start:end] = out_cache_loc[at : at + end - start]
        at += end - start


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every KV buffer (one per layer, K and V: its address in `data_ptrs`, its bytes per
    token in `strides`), the row of each slot in `src_loc` copied to the slot of `tgt_loc`
    (SGLang's Triton kernel `copy_all_layer_kv_cache_tiled`). The buffers are SGLang's own
    CPU tensors, reached by address as the kernel reaches them."""
    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(address)
        buffer_TB = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buffer_TB[tgt_loc] = buffer_TB[src_loc]


def __getattr__(name: str) -> Callable[..., Any]:
    def not_here(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: not in the test stand-in (tests/sglang_live/kernel_standin), "
            "which has only the two CPU ops SGLang's CPU engine calls for a dense decoder"
        )

    not_here.__name__ = name
    return not_here
