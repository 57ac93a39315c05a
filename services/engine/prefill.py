"""What a prefill computes: which sequences share a packed forward, and their prompt scores.

`prefill_groups` cuts newly admitted sequences into packed forwards (paged_batch.py) of at
most PREFILL_TOKENS new tokens; `score_prompt` turns a prefill's kept logits into SGLang's
input logprobs (scheduler.py step 2).
"""

from __future__ import annotations

import torch

from .sequence import InputLogprobs, Sequence

PREFILL_TOKENS = 8192  # new tokens per packed prefill forward (a longer prompt goes alone)
SCORE_CHUNK = 512  # positions per log_softmax: bounds the float32 copies to CHUNK x vocab


def score_prompt(logits_KV: torch.Tensor, seq: Sequence, holder: InputLogprobs) -> None:
    """Fill `holder.values` from the prefill logits at positions start .. L-1 (K = L - start
    rows): values = [None] + [log P(prompt[j] | prompt[:j]) for j in start+1 .. L-1], where
    log P = log_softmax(logits / T) with T = 1 for greedy, as for output logprobs."""
    start, prompt = holder.start, seq.prompt_ids
    assert logits_KV.shape[0] == len(prompt) - start
    temperature = 1.0 if seq.params.greedy else seq.params.temperature
    next_K = torch.tensor(prompt[start + 1 :], dtype=torch.long, device=logits_KV.device)
    scored: list[float | None] = [None]
    for lo in range(0, len(next_K), SCORE_CHUNK):
        hi = min(lo + SCORE_CHUNK, len(next_K))
        logp_CV = torch.log_softmax(logits_KV[lo:hi].float() / temperature, dim=-1)
        scored += logp_CV.gather(-1, next_K[lo:hi, None])[:, 0].tolist()
    holder.values = scored


def prefill_groups(seqs: list[Sequence]) -> list[list[Sequence]]:
    """Split newly admitted sequences into packed prefill forwards of at most PREFILL_TOKENS
    new tokens each, counted over distinct prefixes (the copies of one prompt go with it and
    are prefilled once); a longer prefix is a forward of its own."""
    groups: list[list[Sequence]] = []
    group_of: dict[tuple[tuple[int, ...], int | None], int] = {}
    tokens = 0
    for seq in seqs:
        key = (tuple(seq.prefix_ids()), seq.pending_logprob_start)
        if key in group_of:
            groups[group_of[key]].append(seq)
            continue
        if not groups or tokens + len(key[0]) > PREFILL_TOKENS:
            groups.append([])
            tokens = 0
        groups[-1].append(seq)
        group_of[key] = len(groups) - 1
        tokens += len(key[0])
    return groups
