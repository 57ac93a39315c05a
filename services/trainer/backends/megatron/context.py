"""Context parallelism for the Megatron backend (--context-parallel-size N): the N ranks of a
context parallel group split every sequence between them and hold the whole model each.

The split is megatron's load-balanced one: the (padded) sequence in 2N chunks, rank r taking
chunks r and 2N-1-r, so each rank has as many early (cheap) as late (expensive) causal
queries; megatron's rotary embedding picks the same chunks' positions on each rank. Attention
is the one place where a token needs the others: `ContextParallelAttention` (the layer spec's
core attention) gathers the keys and values of the whole sequence from the group and attends
from this rank's queries with the mask the backend built for them (causal, and block-
diagonal when packed, by position in the whole sequence). Its backward sums the keys' and
values' gradients over the group and keeps this rank's. Megatron's own CP attention is
Transformer Engine's ring attention; this is the all-gather form, exact and simple, which
holds the whole sequence's keys and values on each rank.

The logits of the rank's chunks are gathered back into sequence order on every rank
(`gather_sequence`, whose backward keeps this rank's positions), so the loss code is the
torch backend's and every rank of the group computes the same loss; each rank's parameter
gradients are its tokens' share, summed over the group before the optimizer step (megatron
all-reduces them over the data x context parallel group).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule


def local_positions(length: int, size: int, rank: int) -> torch.Tensor:
    """The sequence positions context parallel rank `rank` of `size` holds (`length`: a
    multiple of 2 x size): chunks rank and 2 x size - 1 - rank of 2 x size."""
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def gathered_order(length: int, size: int) -> torch.Tensor:
    """The sequence positions of an all-gather of every rank's chunks, in gather order."""
    return torch.cat([local_positions(length, size, r) for r in range(size)])


def _group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def _all_gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(_group()))]
    dist.all_gather(parts, t.contiguous(), group=_group())
    return torch.cat(parts, dim=dim)


class _GatherKeys(torch.autograd.Function):
    """[s, b, g, h] keys or values of this rank -> the group's, in gather order along dim 0.
    Backward: every rank's queries used them, so their gradients are summed over the group."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.length = local.shape[0]
        return _all_gather(local, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=_group())
        rank = dist.get_rank(_group())
        return grad[rank * ctx.length : (rank + 1) * ctx.length]


class _GatherSequence(torch.autograd.Function):
    """[B, s, V] logits of this rank's positions -> [B, S, V] in sequence order. Every rank
    computes the same loss from them, so the backward keeps this rank's positions' gradient."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, mine: torch.Tensor, order: torch.Tensor
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.mine = mine
        gathered = _all_gather(local, 1)
        out = torch.empty_like(gathered)
        out[:, order] = gathered
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad[:, ctx.mine], None, None


def gather_sequence(local: torch.Tensor, length: int) -> torch.Tensor:
    group = _group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return _GatherSequence.apply(
        local, local_positions(length, size, rank), gathered_order(length, size)
    )


def split(
    ids: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's tokens and positions, and the rows of the [1, 1, S, S] mask (True where
    attention is masked) for its queries, its columns in gather order (the keys'
    ContextParallelAttention sees)."""
    group = _group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = ids.shape[1]
    mine, order = local_positions(length, size, rank), gathered_order(length, size)
    return ids[:, mine], positions[:, mine], masked[:, :, mine][:, :, :, order]


class ContextParallelAttention(MegatronModule):
    """Core attention over the whole sequence for this rank's queries (module docstring);
    megatron's local DotProductAttention refuses context parallelism."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 **_: Any) -> None:  # fmt: skip
        super().__init__(config=config)
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        groups = config.num_query_groups // config.tensor_model_parallel_size
        self.per_group = heads // groups
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:  # fmt: skip
        """query [sq, b, np, hn], key and value [sk, b, ng, hn] (this rank's); the mask
        [1, 1, sq, S] built by `split`. Returns [sq, b, np * hn]."""
        key = _GatherKeys.apply(key).repeat_interleave(self.per_group, dim=2)
        value = _GatherKeys.apply(value).repeat_interleave(self.per_group, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=~attention_mask, scale=self.scale
        )
        sq, b = query.shape[:2]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
