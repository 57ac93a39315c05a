"""Attention over the token pool: each request reads its own tokens, and only those.

Every forward of the engine (prefill and decode) is one packed sequence of N new tokens,
input_ids [1, N]: decode feeds each running row's last token, prefill the new tokens of
every prompt back to back, with no padding, so the Linears compute exactly N tokens. The
model's own layers run unchanged; only attention is ours, registered with transformers as
the attention implementation "millstream_paged" (`use_paged_attention`). The model calls it
per layer with the N tokens' queries, keys and values (after RoPE); the step's `StepPlan` is
set for the forward's thread (`planned`), and also passed where a mask would go
(`attention_mask={"full_attention": plan}`), a mapping that models such as Qwen2 use as is
(no mask built) and others such as Llama ignore (their mask function for this attention
gives None). Per layer it
  1. writes the N keys and values into their pool slots (`plan.write_slots`), then
  2. for each group of requests of similar context length, gathers their context's keys
     and values from the pool by slot ([g, L, H, D], L the group's longest context, shorter
     ones padded with the null slot and masked), and runs PyTorch's scaled_dot_product_
     attention over them; the outputs go back to their packed positions.
So a step reads Σ over groups of g x L tokens, at most PAD_RATIO x the live tokens, whatever
the pool's size: decode cost follows the live tokens. Rows are grouped by length so that a
4k-token row beside 63 short ones does not make every short row read 4k columns.

Why SDPA over gathered slots, not FlexAttention or FlashInfer: it runs the same everywhere
(the CPU's `make test`, a GPU with nothing but torch), it needs no compilation (FlexAttention
on the CPU compiles through Inductor, minutes of start-up here), and with grouping its
reads are within PAD_RATIO of a ragged kernel's. The gather is a copy of the live keys per
layer, what the dynamic cache's per-step concatenation cost before; a ragged kernel that
reads the pool in place (FlashInfer's decode, where installed) is the next step on a GPU.

Grouped-query attention without `repeat_kv`: a decode group's queries [g, Hq, 1, D] are
viewed as [g, Hkv, Hq/Hkv, D], the query heads that share a kv head stacked as rows of one
"query sequence" (transformers' pack_gqa), so keys and values are read once per kv head and
a length mask [g, 1, 1, L] broadcasts over them. Prefill groups use SDPA's enable_gqa; a
group of fresh prompts of one length needs no mask (is_causal), so a GPU's fused kernels
can take it.

CUDA graphs (paged_batch.py) capture the decode step with one group of fixed shape per
(batch size, context bucket): the plan's tensors are then static buffers that the replay
fills; `mask` is computed from the lengths on the device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

PAGED = "millstream_paged"
_active = threading.local()  # the plan of the forward running on this thread
PAD_RATIO = 2.0  # a group reads at most 2 tokens per live one


@dataclass
class AttnGroup:
    """Requests attended together: `rows` of up to `tq` queries over up to `width` keys.

    q_index  [rows * tq] positions in the packed N of each query (padding: any position)
    slots    [rows * width] pool slots of each request's context (padding: the null slot)
    mask     [rows, 1, tq, width] bool, True where a query may attend; None: all may
    valid    [rows * tq] bool, the real queries among q_index; None: all are real
    """

    rows: int
    tq: int
    width: int
    q_index: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    causal: bool = False  # no mask: every request's queries are its whole context, causal


@dataclass
class StepPlan:
    """What one forward's attention needs, built once per step and read by every layer."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    write_slots: torch.Tensor  # [N] the slot of each packed token
    groups: list[AttnGroup] = field(default_factory=list)
    # One group whose queries are the packed tokens 0..N-1 in order: its output is the
    # layer's as it comes (no scatter).
    direct: bool = False

    @property
    def read_tokens(self) -> int:
        """Keys each layer gathers: what attention costs, padding included."""
        return sum(g.rows * g.width for g in self.groups)


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` split into groups (longest first; each in index order) where
    padding every member to the group's longest reads at most PAD_RATIO tokens per real one."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    width = real = 0
    for i in order:
        if groups and width * (len(groups[-1]) + 1) <= PAD_RATIO * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            width = real = lengths[i]
    return [sorted(g) for g in groups]


def decode_group(
    rows: torch.Tensor, slots_RL: torch.Tensor, lengths: torch.Tensor | None, width: int
) -> AttnGroup:
    """A decode group: `rows` (positions in the packed N, one query each), their index
    tables `slots_RL` [rows, >= width] and context lengths (a device tensor; None: every
    row is `width` long, no mask)."""
    n = len(rows)
    table = slots_RL[:, :width]
    mask = None
    if lengths is not None:
        mask = (torch.arange(width, device=lengths.device) < lengths[:, None])[:, None, None, :]
    return AttnGroup(n, 1, width, rows, table.reshape(-1), mask)


def prefill_group(
    q_starts: list[int], new: list[int], contexts: list[int], slots_RL: torch.Tensor
) -> AttnGroup:
    """A prefill group: request r's `new[r]` queries start at packed position q_starts[r]
    and are the last new[r] of its contexts[r] tokens, whose slots are slots_RL[r]."""
    device = slots_RL.device
    rows, tq, width = len(new), max(new), max(contexts)
    if new == contexts and len(set(new)) == 1:  # fresh prompts of one length: plain causal
        q_index = torch.cat([torch.arange(s, s + n) for s, n in zip(q_starts, new, strict=True)])
        flat = slots_RL[:, :width].reshape(-1)
        return AttnGroup(rows, tq, width, q_index.to(device), flat, causal=True)
    t_Q = torch.arange(tq)
    new_R1 = torch.tensor(new)[:, None]
    start_R1 = torch.tensor(q_starts)[:, None]
    valid_RQ = t_Q[None, :] < new_R1
    q_RQ = torch.where(valid_RQ, start_R1 + t_Q[None, :], start_R1)  # padding: a real one
    # Query t of request r sits at context index contexts[r] - new[r] + t: it sees keys up
    # to there (causal); padding queries see their request's first key (finite, dropped).
    at_RQ = torch.tensor(contexts)[:, None] - new_R1 + t_Q[None, :]
    k_L = torch.arange(width)
    mask = (k_L[None, None, :] <= at_RQ[:, :, None]) & valid_RQ[:, :, None]
    mask[:, :, 0] |= ~valid_RQ
    valid = valid_RQ.reshape(-1)
    return AttnGroup(
        rows,
        tq,
        width,
        q_RQ.reshape(-1).to(device),
        slots_RL[:, :width].reshape(-1),
        mask[:, None].to(device),
        None if bool(valid.all()) else valid.to(device),
    )


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (module docstring); query [1, Hq, N, D], key and
    value [1, Hkv, N, D]; returns [1, N, Hq, D]."""
    plan = attention_mask if isinstance(attention_mask, StepPlan) else _active.plan
    layer = module.layer_idx
    pool_k, pool_v = plan.keys[layer], plan.values[layer]
    pool_k.index_copy_(0, plan.write_slots, key[0].transpose(0, 1))
    pool_v.index_copy_(0, plan.write_slots, value[0].transpose(0, 1))
    q_NHD = query[0].transpose(0, 1)
    n, hq, d = q_NHD.shape
    hkv = pool_k.shape[1]
    out_NHD = None if plan.direct else q_NHD.new_empty(n, hq, d)
    for g in plan.groups:
        k = pool_k.index_select(0, g.slots).view(g.rows, g.width, hkv, d).transpose(1, 2)
        v = pool_v.index_select(0, g.slots).view(g.rows, g.width, hkv, d).transpose(1, 2)
        q = q_NHD if plan.direct and g.tq == 1 else q_NHD.index_select(0, g.q_index)
        if g.tq == 1:  # decode: the query heads of a kv head as one sequence (pack GQA)
            q = q.view(g.rows, hkv, hq // hkv, d)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scaling)
        else:
            q = q.view(g.rows, g.tq, hq, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=g.mask, is_causal=g.causal, scale=scaling, enable_gqa=hq != hkv
            ).transpose(1, 2)
        o = o.reshape(g.rows * g.tq, hq, d)
        if out_NHD is None:
            return o[None], None
        if g.valid is not None:
            out_NHD.index_copy_(0, g.q_index[g.valid], o[g.valid])
        else:
            out_NHD.index_copy_(0, g.q_index, o)
    assert out_NHD is not None
    return out_NHD[None], None


@contextlib.contextmanager
def planned(plan: StepPlan) -> Iterator[dict[str, StepPlan]]:
    """Make `plan` the one this thread's forward attends with, and give the mask mapping to
    pass as `attention_mask` (which spares models that take it their mask building)."""
    _active.plan = plan
    try:
        yield {"full_attention": plan}
    finally:
        _active.plan = None


def use_paged_attention(model: Any) -> None:
    """Register `paged_attention` with transformers and make it `model`'s attention."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED, paged_attention)
    model.set_attn_implementation(PAGED)
