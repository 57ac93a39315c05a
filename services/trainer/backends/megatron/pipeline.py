"""Pipeline parallelism for the Megatron backend (--pipeline-model-parallel-size N): each of N
consecutive stages holds 1/N of the layers (megatron_model.build), the first the embedding,
the last the final norm and the output layer.

A forward runs stage after stage: each stage receives the hidden states from the one before
(megatron's `set_input_tensor`), runs its layers and sends them on; the last stage computes
the logits and broadcasts them to the pipeline group, so every stage returns the same logits
and runs the torch backend's loss code unchanged (the loss is not split: every stage computes
it, the same). A backward runs the other way: the last stage's backward reaches its received
hidden states, whose hook sends their gradient to the stage before; an earlier stage's
logits stand on `_FromLaterStages`, whose backward receives that gradient in place of the
logits' and carries it into the stage's own layers. So each stage's parameters get exactly
their gradient, in the same order of calls on every stage (sends and receives match, micro-
batch by micro-batch).

With tensor parallelism too, each tensor parallel rank of a stage talks to the same rank of
the next (the hidden states between stages are whole on each, or under sequence parallelism
its slice of the sequence), and the logits are whole on each already.

This is megatron's "all forward, all backward" order without its 1F1B schedule: the stages
run one after another, not overlapped, and the logits travel back to the earlier stages (the
cost of sharing the loss code; megatron computes the loss on the last stage only). What it
buys is memory: each stage holds its layers' weights, gradients and Adam state.

A tied model (Qwen2's embedding as the output layer) is built untied across the stages, as
megatron does: the first stage's embedding and the last stage's output layer are two copies,
whose gradients are summed over megatron's embedding group before each step
(`sum_tied_gradients`), so they stay equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _FromLaterStages(torch.autograd.Function):
    """An earlier stage's logits (received), linked to the hidden states it sent on: the
    backward receives the gradient of those hidden states from the next stage."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, logits: torch.Tensor, next_rank: int
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.shape, ctx.dtype, ctx.next_rank = hidden.shape, hidden.dtype, next_rank
        return logits.clone()

    @staticmethod
    def backward(ctx: Any, grad_logits: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        grad = torch.empty(ctx.shape, dtype=ctx.dtype)
        dist.recv(grad, src=ctx.next_rank)
        return grad, None, None


def stage_logits(
    model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, mask: Any, vocab_rows: int
) -> torch.Tensor:
    """[B, S, vocab_rows] logits of a forward through every stage, on every stage (a
    collective of the pipeline group: each of its ranks calls it with the same rows). The
    hidden states and logits cross in the model's dtype (--bf16: bf16)."""
    from megatron.core import parallel_state as ps

    gpt = getattr(model, "module", model)  # DDP wraps it with data parallel ranks
    B, S = ids.shape
    dtype = next(gpt.parameters()).dtype
    group = ps.get_pipeline_model_parallel_group()
    last = ps.get_pipeline_model_parallel_last_rank()
    if not ps.is_pipeline_first_stage():
        # megatron's [s, b, h]; sequence parallel: this tensor parallel rank's slice of s
        tensor_parallel = gpt.config.tensor_model_parallel_size
        rows = S // tensor_parallel if gpt.config.sequence_parallel else S
        hidden_in = torch.empty(rows, B, gpt.config.hidden_size, dtype=dtype)
        prev = ps.get_pipeline_model_parallel_prev_rank()
        dist.recv(hidden_in, src=prev)
        if torch.is_grad_enabled():
            hidden_in.requires_grad_()
            hidden_in.register_hook(lambda grad: dist.send(grad.contiguous(), dst=prev))
        gpt.set_input_tensor(hidden_in)
    out = model(ids, positions, attention_mask=mask)
    if ps.is_pipeline_last_stage():
        dist.broadcast(out.detach().contiguous(), src=last, group=group)
        return out
    next_rank = ps.get_pipeline_model_parallel_next_rank()
    dist.send(out.detach().contiguous(), dst=next_rank)
    logits = torch.empty(B, S, vocab_rows, dtype=dtype)
    dist.broadcast(logits, src=last, group=group)
    return _FromLaterStages.apply(out, logits, next_rank)


def stage_of(name: str, num_layers: int, stages: int) -> int:
    """The pipeline stage holding megatron parameter `name` (global layer indices)."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2]) // (num_layers // stages)
    return stages - 1  # the final norm and the output layer


def gather_stages(
    local: dict[str, torch.Tensor],
    shapes: dict[str, torch.Size],
    num_layers: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Every stage's weights (megatron names, global layer indices) on every rank of the
    pipeline group: each stage broadcasts its own as one flat tensor, in name order. `local`:
    this stage's; `shapes`: every name's shape (the whole model's); `dtype`: the weights'."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    stages = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group)
    out: dict[str, torch.Tensor] = {}
    for stage in range(stages):
        names = sorted(n for n in shapes if stage_of(n, num_layers, stages) == stage)
        sizes = [shapes[n].numel() for n in names]
        if stage == ps.get_pipeline_model_parallel_rank():
            flat = torch.cat([local[n].reshape(-1) for n in names])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype)
        dist.broadcast(flat, src=ranks[stage], group=group)
        for name, part in zip(names, flat.split(sizes), strict=True):
            out[name] = part.view(shapes[name])
    return out


def sum_tied_gradients(model: torch.nn.Module, grad_param: Any = lambda p: p) -> None:
    """A tied model's two copies (the first stage's embedding, the last stage's output layer):
    each has the gradient of its own use; their sum is the tied weight's, given to both.
    `grad_param(weight)`: the parameter holding its gradient (--bf16: its fp32 master)."""
    from megatron.core import parallel_state as ps

    if not ps.is_rank_in_embedding_group():
        return
    gpt = getattr(model, "module", model)
    weight = grad_param(
        gpt.embedding.word_embeddings.weight
        if ps.is_pipeline_first_stage()
        else gpt.output_layer.weight
    )
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=ps.get_embedding_group())
