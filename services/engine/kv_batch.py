"""The running batch: rows that decode together over one left-padded KV cache.

Layout. Every layer of the transformers DynamicCache holds keys/values `kv_BHTD` (batch,
kv heads, cache columns, head dim). Row b's real tokens sit right-aligned in the T columns;
columns to their left are padding, zero in `kv_BHTD` and 0 in `mask_BT`. Keys are cached
after RoPE, so a column's content does not depend on where it sits: moving a row's tokens
to other columns (padding it further on join, trimming on leave) keeps them valid. What the
model needs per step is therefore
    input_ids_B1     the last sampled token of each row,
    attention_mask   mask_BT with a 1 appended (the new column),
    position_ids_B1  each row's true position (prompt + output - 1), not its column.
Padding keys get -inf scores through the mask, so a row's logits equal those of the row run
alone up to float summation order (tests check 1e-4 against a fresh full forward).

Join: newcomers are prefilled together (left-padded, model_runner.prefill), then both
caches are left-padded to the longer length and concatenated along the batch. Leave: rows
are index-selected out and columns that are padding for every remaining row are dropped,
so T tracks the longest live row, not the longest row ever seen.
"""

from __future__ import annotations

from typing import Any

import torch

from .model_runner import cache_kwarg
from .sequence import Sequence


def _pad_left(cache: Any, mask_BT: torch.Tensor, width: int) -> torch.Tensor:
    """Grow `cache` and its mask to `width` columns by padding on the left."""
    extra = width - mask_BT.shape[1]
    if extra <= 0:
        return mask_BT
    for layer in cache.layers:
        batch, heads, _, dim = layer.keys.shape
        zeros_BHED = layer.keys.new_zeros(batch, heads, extra, dim)
        layer.keys = torch.cat([zeros_BHED, layer.keys], dim=2)
        layer.values = torch.cat([zeros_BHED.to(layer.values.dtype), layer.values], dim=2)
    return torch.cat([mask_BT.new_zeros(mask_BT.shape[0], extra), mask_BT], dim=1)


class RunningBatch:
    """Sequences decoding together; row i of the cache belongs to `seqs[i]`."""

    def __init__(self) -> None:
        self.seqs: list[Sequence] = []
        self.cache: Any = None
        self.mask_BT: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        return 0 if self.mask_BT is None else self.mask_BT.shape[1]

    def clear(self) -> None:
        self.seqs, self.cache, self.mask_BT = [], None, None

    def release(self) -> int:
        """Drop the cache (its rows were retracted); the dynamic cache holds no other memory."""
        self.clear()
        return 0

    def resume(self) -> int:
        return 0  # grown again by the next prefill

    def forget_graphs(self) -> None:
        pass  # eager decoding captures nothing

    def warm_graphs(self) -> None:
        pass

    def add(self, seqs: list[Sequence], cache: Any, mask_BT: torch.Tensor) -> None:
        """Merge prefilled rows (their own cache, `mask_BT` marking real columns) in."""
        if not seqs:
            return
        if not self.seqs:
            self.seqs, self.cache, self.mask_BT = list(seqs), cache, mask_BT
            return
        assert self.mask_BT is not None
        width = max(self.width, mask_BT.shape[1])
        self.mask_BT = _pad_left(self.cache, self.mask_BT, width)
        mask_BT = _pad_left(cache, mask_BT, width)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask_BT = torch.cat([self.mask_BT, mask_BT], dim=0)
        self.seqs.extend(seqs)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order) and drop all-padding columns."""
        if len(rows) == len(self.seqs):
            return
        if not rows:
            self.clear()
            return
        assert self.mask_BT is not None
        index_B = torch.tensor(rows, device=self.mask_BT.device)
        live_T = self.mask_BT[index_B].any(dim=0)
        first = int(live_T.nonzero()[0])
        for layer in self.cache.layers:
            layer.keys = layer.keys[index_B, :, first:].contiguous()
            layer.values = layer.values[index_B, :, first:].contiguous()
        self.mask_BT = self.mask_BT[index_B, first:]
        self.seqs = [self.seqs[i] for i in rows]

    @torch.inference_mode()
    def decode(self, model: Any) -> torch.Tensor:
        """One decode step over every row; returns next-token logits_BV."""
        assert self.mask_BT is not None
        device = self.mask_BT.device
        input_ids_B1 = torch.tensor([[s.output_ids[-1]] for s in self.seqs], device=device)
        position_ids_B1 = torch.tensor([[s.next_position] for s in self.seqs], device=device)
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones(len(self.seqs), 1)], dim=1)
        out = model(
            input_ids=input_ids_B1,
            attention_mask=self.mask_BT,
            position_ids=position_ids_B1,
            use_cache=True,
            **{cache_kwarg(model): self.cache},
        )
        return out.logits[:, -1, :]
