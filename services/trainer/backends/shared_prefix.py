"""The shared-prompt layout of a micro-batch: each prompt forwarded once for all its samples.

A GRPO group is n responses to one prompt, and the padded layout forwards that prompt n times
(for the peer benchmark's addition task, 7 of a sample's ~11 tokens). Here the samples of a
micro-batch that share their prompt tokens go in one row instead:

    row r:  prompt (P tokens) | response a | response b | ... | padding
    positions 0..P-1            P..P+len(a)-1, P..P+len(b)-1, ...
    attention: causal, and a response sees the prompt and itself only

so every response token sees exactly what it sees in a row of its own, at the same position:
the logits are the same (up to float rounding) and so is the gradient, summed over the
responses at the prompt's positions as it is over the n separate rows. The engine's prefill
does the same for a request's n samples (engine/scheduler.py). Response token k of a sample is
predicted at the prompt's last position for k = 0, else at the sample's own position k - 1.

The mask is a 4-D [R, 1, L, L] mask, which transformers passes to the attention as it is
(sdpa: True where a query may attend; eager: 0 or the dtype's min, added to the scores).
`cheaper` picks this layout only where it computes less: it removes prompt tokens, but each
row is as long as all of its responses together, and attention grows with the square of a
row's length: with long responses the padded layout wins (a 200-token prompt and eight
1000-token responses on a 7B model), and it is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import TrainSample


def group_by_prompt(samples: list[TrainSample]) -> list[list[int]]:
    """Indices of the samples, grouped by their prompt tokens, in order of first appearance."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        rows.setdefault(tuple(s.tokens[: s.prompt_len]), []).append(i)
    return list(rows.values())


def cheaper(
    samples: list[TrainSample], rows: list[list[int]], hidden: int, intermediate: int
) -> bool:
    """Whether the shared layout of `rows` costs fewer multiply-adds than one padded row per
    sample: per token, the projections and MLP (4h^2 + 3hI) and attention over the row
    (2hL). A model that shares no prompt (one sample per row) gains nothing."""
    if len(rows) == len(samples):
        return False
    per_token = 4 * hidden * hidden + 3 * hidden * intermediate
    S = max(len(s.tokens) for s in samples)
    L = max(row_length(samples, row) for row in rows)
    padded = len(samples) * S * (per_token + 2 * hidden * S)
    shared = len(rows) * L * (per_token + 2 * hidden * L)
    return shared < padded


def row_length(samples: list[TrainSample], row: list[int]) -> int:
    first = samples[row[0]]
    return first.prompt_len + sum(samples[i].response_len for i in row)


@dataclass
class Layout:
    """Token ids, positions and segments of each row ([R, L]: segment 0 the prompt, j + 1
    the row's j-th response, -1 padding), and per sample (B) its row and the columns that
    predict its response tokens (T each, zero-padded)."""

    ids: list[list[int]]
    positions: list[list[int]]
    segments: list[list[int]]
    row_of: list[int]
    cols: list[list[int]]

    def mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[R, 1, L, L]: bool, True where query q may attend to key k (k <= q, and k in the
        prompt or in q's own segment); with `dtype`, 0 there and the dtype's min elsewhere.
        A padding query sees the prompt and the padding before it (never an empty row)."""
        seg = torch.tensor(self.segments)
        L = seg.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        visible = (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0)
        allowed = (causal[None] & visible)[:, None]
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def layout(samples: list[TrainSample], rows: list[list[int]], T: int) -> Layout:
    L = max(row_length(samples, row) for row in rows)
    ids: list[list[int]] = []
    positions: list[list[int]] = []
    segments: list[list[int]] = []
    row_of = [0] * len(samples)
    cols: list[list[int]] = [[] for _ in samples]
    for r, row in enumerate(rows):
        first = samples[row[0]]
        P = first.prompt_len
        row_ids = list(first.tokens[:P])
        row_pos = list(range(P))
        row_seg = [0] * P
        for j, i in enumerate(row):
            s = samples[i]
            n, start = s.response_len, len(row_ids)
            row_ids += s.tokens[P:]
            row_pos += range(P, P + n)
            row_seg += [j + 1] * n
            row_of[i] = r
            predicting = [P - 1, *range(start, start + n - 1)] if n else []
            cols[i] = predicting + [0] * (T - n)
        gap = L - len(row_ids)
        ids.append(row_ids + [0] * gap)
        positions.append(row_pos + [0] * gap)
        segments.append(row_seg + [-1] * gap)
    return Layout(ids, positions, segments, row_of, cols)
