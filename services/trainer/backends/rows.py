"""A micro-batch as a forward's inputs, for both backends (loop.py `StepLoop._inputs`).

Padded: one row per sample, or one per prompt for the samples that share it, where that
computes less (shared_prefix.py). Packed (--use-dynamic-batch-size): all samples in one row,
position ids restarting at each, which transformers turns into a block-diagonal causal mask
(the megatron backend builds that mask itself); or each shared prompt once in that row, with
its samples' responses after it (shared_prefix.py's mask). Whatever the layout, a sample's
response token k is tokens[p + k] (p its prompt's length), predicted by the logits at the
layout's column for p + k - 1 in the sample's row: `with_targets` gives each sample those T
columns, the targets and which of them are real, so what reads the logits never sees the
layout.

Also the per-sample lists the loss reads beside the logprobs, padded to [B, T] (`pad`) and
split back (`unpad`), and the probe that finds whether a model takes the shared-prompt mask
(`shared_prompt_mask`: a model whose attention drops a custom 4-D mask fails it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from . import shared_prefix
from .base import TrainSample
from .critic import ValueModel

log = logging.getLogger(__name__)

# What a forward takes: (model kwargs, (row_BT, col_BT), target_BT, valid_BT) (`with_targets`).
Inputs = tuple[
    dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor
]
# A micro-batch's layout (`row_layout`, `shared_prompt_layout`): model kwargs, and per
# sample its row and the T columns that predict its response tokens.
Layout = tuple[dict[str, torch.Tensor], list[int], list[list[int]]]


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 for the softmax; fp32 and fp64 (the exactness tests) stay."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def pad(rows: list[list[float]] | list[torch.Tensor], T: int) -> torch.Tensor:
    """[len(rows), T] float32, each row zero-padded on the right: one tensor built at once
    (a copy per row cost ~10 us each, 5 ms of a small model's train step)."""
    if not rows:
        return torch.zeros(0, T)
    if all(isinstance(row, torch.Tensor) for row in rows):
        out = torch.zeros(len(rows), T)
        flat = torch.cat([row.reshape(-1).to(torch.float32) for row in rows])  # type: ignore[union-attr]
        lengths = torch.tensor([len(row) for row in rows])
        out[torch.arange(T)[None, :] < lengths[:, None]] = flat
        return out
    return torch.tensor([[*row, *([0.0] * (T - len(row)))] for row in rows], dtype=torch.float32)


def unpad(x_BT: torch.Tensor, samples: list[TrainSample]) -> list[torch.Tensor]:
    return [x_BT[i, : s.response_len].clone() for i, s in enumerate(samples)]


def row_layout(samples: list[TrainSample], T: int, packed: bool) -> Layout:
    """One row per sample (padded), or all of them in one row (packed)."""
    lengths = [len(s.tokens) for s in samples]
    S = max(lengths)
    # Python lists first, one tensor each at the end (a tensor per sample is most of the
    # cost for small models).
    cols: list[list[int]] = []
    start = 0
    for s in samples:
        n, gap = len(s.tokens), T - s.response_len
        cols.append([*range(start + s.prompt_len - 1, start + n - 1), *([0] * gap)])
        if packed:
            start += n
    rows = [0] * len(samples) if packed else list(range(len(samples)))
    if packed:
        ids = [t for s in samples for t in s.tokens]
        pos = [j for n in lengths for j in range(n)]
        inputs = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos])}
    else:
        ids_RS = torch.tensor([[*s.tokens, *([0] * (S - len(s.tokens)))] for s in samples])
        attn_RS = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
        inputs = {"input_ids": ids_RS, "attention_mask": attn_RS}
    return inputs, rows, cols


def shared_prompt_layout(
    samples: list[TrainSample],
    groups: list[list[int]],
    T: int,
    kind: str,
    packed: bool,
    float_dtype: torch.dtype,
) -> Layout:
    """Each group of `groups` (samples sharing a prompt) in a row of its own, or all in one
    packed row, with the mask of `kind` ("bool", or "float": additive, in `float_dtype`)."""
    lay = shared_prefix.layout(samples, groups, T, packed)
    inputs = {
        "input_ids": torch.tensor(lay.ids),
        "position_ids": torch.tensor(lay.positions),
        "attention_mask": lay.mask(float_dtype if kind == "float" else None),
    }
    return inputs, lay.row_of, lay.cols


def with_targets(
    samples: list[TrainSample],
    T: int,
    layout: Layout,
    on: Callable[[torch.Tensor], torch.Tensor],
) -> Inputs:
    """A layout's tensors where the models are (`on`), with each sample's response tokens as
    targets and which of its T positions are real: the same whatever the layout."""
    inputs, rows, cols = layout
    targets = [[*s.tokens[s.prompt_len :], *([0] * (T - s.response_len))] for s in samples]
    valid = [[1.0] * s.response_len + [0.0] * (T - s.response_len) for s in samples]
    row_BT = torch.tensor(rows)[:, None].expand(len(samples), T).contiguous()
    return (
        {name: on(x) for name, x in inputs.items()},
        (on(row_BT), on(torch.tensor(cols))),
        on(torch.tensor(targets)),
        on(torch.tensor(valid)),
    )


def prompt_rows(
    samples: list[TrainSample], prompt_mask: str | None, config: object, packed: bool
) -> list[list[int]] | None:
    """The groups of a micro-batch's samples that share a prompt, where the shared-prompt
    layout computes less for a model of `config` (padded: a row per group; packed: one row
    of them); None without a `prompt_mask`."""
    if prompt_mask is None:
        return None
    groups = shared_prefix.group_by_prompt(samples)
    hidden = config.hidden_size  # type: ignore[attr-defined]
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    pays = shared_prefix.cheaper(samples, groups, hidden, intermediate, packed)
    return groups if pays else None


def shared_prompt_mask(
    models: list[torch.nn.Module | None],
    vocab: int,
    packed: bool,
    float_dtype: torch.dtype,
    on: Callable[[torch.Tensor], torch.Tensor],
) -> str | None:
    """The mask kind every one of `models` takes ("bool" for sdpa attention, "float" for
    eager), found by forwarding a probe both ways, or None."""
    kinds = set()
    for model in models:
        if model is None:
            continue
        config = model.body.config if isinstance(model, ValueModel) else model.config
        impl = getattr(config, "_attn_implementation", None)
        kind = {"sdpa": "bool", "eager": "float"}.get(impl or "")
        if kind is None or not _takes_shared_prompts(model, kind, vocab, packed, float_dtype, on):
            log.info("one row per sample: %s (%s attention) takes no custom 4-D mask",
                     type(model).__name__, impl)  # fmt: skip
            return None
        kinds.add(kind)
    return kinds.pop() if len(kinds) == 1 else None


def _takes_shared_prompts(
    model: torch.nn.Module,
    kind: str,
    vocab: int,
    packed: bool,
    float_dtype: torch.dtype,
    on: Callable[[torch.Tensor], torch.Tensor],
) -> bool:
    """Whether `model` gives the same outputs for a probe in both layouts."""
    prompt = [t % vocab for t in (5, 3, 7)]
    probe = [
        TrainSample(tokens=[*prompt, *(t % vocab for t in r)], prompt_len=3,
                    loss_mask=[1] * len(r), rollout_logprobs=[0.0] * len(r), reward=0.0)
        for r in ((2, 9, 4), (8,), (6, 1))
    ]  # fmt: skip
    rows = shared_prefix.group_by_prompt(probe)

    T = max(s.response_len for s in probe)

    def outputs(shared: bool) -> torch.Tensor:
        layout = (
            shared_prompt_layout(probe, rows, T, kind, packed, float_dtype)
            if shared
            else row_layout(probe, T, packed)
        )
        inputs, (row_BT, col_BT), _, valid_BT = with_targets(probe, T, layout, on)
        with torch.no_grad():
            out = model(**inputs)
        out = out if isinstance(out, torch.Tensor) else out.logits
        return out[row_BT, col_BT][valid_BT.bool()].float()

    training = model.training
    model.eval()  # no dropout: the two forwards must agree
    try:
        padded, shared = outputs(False), outputs(True)
    except Exception as err:  # a model that refuses the mask's shape or kind
        log.info("shared-prompt probe of %s failed: %s", type(model).__name__, err)
        return False
    finally:
        model.train(training)
    return torch.allclose(padded, shared, rtol=1e-3, atol=1e-3)
