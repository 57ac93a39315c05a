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

Packed (--use-dynamic-batch-size: one row per micro-batch), the groups go one after another
in that row, each its own block: positions restart at each prompt, and nothing attends
across two groups.

The mask is a 4-D [R, 1, L, L] mask, which transformers passes to the attention as it is
(sdpa: True where a query may attend; eager: 0 or the dtype's min, added to the scores).
`cheaper` picks this layout only where it computes less: it removes prompt tokens, but each
padded row is as long as all of its responses together, and attention grows with the square
of a row's length: with long responses the padded layout wins (a 200-token prompt and eight
1000-token responses on a 7B model), and it is kept. A packed row only gets shorter.
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
    samples: list[TrainSample],
    rows: list[list[int]],
    hidden: int,
    intermediate: int,
    packed: bool = False,
) -> bool:
    """Whether the shared layout of `rows` costs fewer multiply-adds than one padded row per
    sample: per token, the projections and MLP (4h^2 + 3hI) and attention over the row
    (2hL). A batch that shares no prompt (one sample per row) gains nothing; a packed one
    gains from any shared prompt."""
    if len(rows) == len(samples):
        return False
    if packed:
        return True
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
    """Token ids, positions, groups and segments of each row ([R, L]: group g the row's g-th
    prompt and its responses, -1 padding; segment 0 a prompt, j + 1 its group's j-th
    response, -1 padding), and per sample (B) its row and the columns that predict its
    response tokens (T each, zero-padded)."""

    ids: list[list[int]]
    positions: list[list[int]]
    groups: list[list[int]]
    segments: list[list[int]]
    row_of: list[int]
    cols: list[list[int]]

    def mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[R, 1, L, L]: bool, True where query q may attend to key k (k <= q, in q's group,
        and in its prompt or q's own segment); with `dtype`, 0 there and the dtype's min
        elsewhere. A padding query sees the padding before it (never an empty row)."""
        seg, group = torch.tensor(self.segments), torch.tensor(self.groups)
        L = seg.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        same_group = group[:, :, None] == group[:, None, :]
        visible = (seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0)
        allowed = (causal[None] & same_group & visible)[:, None]
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def layout(
    samples: list[TrainSample], groups: list[list[int]], T: int, packed: bool = False
) -> Layout:
    """Each group of samples (`group_by_prompt`) in a row of its own, or (`packed`) all of
    them one after another in one row."""
    rows: list[list[list[int]]] = [groups] if packed else [[g] for g in groups]
    L = max(sum(row_length(samples, g) for g in row) for row in rows)
    out = Layout([], [], [], [], [0] * len(samples), [[] for _ in samples])
    for r, row in enumerate(rows):
        ids: list[int] = []
        pos: list[int] = []
        grp: list[int] = []
        seg: list[int] = []
        for g, group in enumerate(row):
            first = samples[group[0]]
            P, prompt_start = first.prompt_len, len(ids)
            ids += first.tokens[:P]
            pos += range(P)
            grp += [g] * P
            seg += [0] * P
            for j, i in enumerate(group):
                s = samples[i]
                n, start = s.response_len, len(ids)
                ids += s.tokens[P:]
                pos += range(P, P + n)
                grp += [g] * n
                seg += [j + 1] * n
                out.row_of[i] = r
                predicting = [prompt_start + P - 1, *range(start, start + n - 1)] if n else []
                out.cols[i] = predicting + [0] * (T - n)
        gap = L - len(ids)
        out.ids.append(ids + [0] * gap)
        out.positions.append(pos + [0] * gap)
        out.groups.append(grp + [-1] * gap)
        out.segments.append(seg + [-1] * gap)
    return out
