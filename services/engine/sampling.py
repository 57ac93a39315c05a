"""Next-token sampling for a batch of rows, each with its own parameters and RNG.

Logprob (SGLang's default): the reported logprob of a token is
    log_softmax(logits / T)[token],  T = temperature (T = 1 for greedy, temperature < 1e-6),
taken BEFORE top-k / top-p / min-p truncation, so a trainer can recompute it from a plain
forward pass over prompt + response.

Sampling: greedy rows take the argmax of the raw logits. Other rows draw from
softmax(logits / T) restricted to the tokens that survive all three filters
    top_k:  the k most likely (-1: off),
    top_p:  the smallest prefix of the sorted distribution whose mass reaches p (the first
            token always survives),
    min_p:  tokens with p >= min_p * p_max,
renormalised. Every row draws one uniform u from its own `random.Random`, so a request
seeded with `sampling_seed` samples the same tokens whatever else shares its batch; the
token is then picked for all rows at once by inverse CDF (the first token whose cumulative
probability exceeds u times the row's total), one searchsorted over the batch instead of a
multinomial call per row (that loop was a third of the engine's step time).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .executor.host import host_tensor

GREEDY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's resolved sampling parameters (SGLang's names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def _filter_probs(probs_BV: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero the tokens top-k / top-p / min-p remove; returns probabilities in sorted order
    together with the sort index (so row b's j-th column is token order_BV[b, j])."""
    vocab, device = probs_BV.shape[-1], probs_BV.device
    top_k_B = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p_B = torch.tensor([p.top_p for p in params], dtype=probs_BV.dtype, device=device)
    min_p_B = torch.tensor([p.min_p for p in params], dtype=probs_BV.dtype, device=device)
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=device)
    keep_BV = rank_V[None, :] < top_k_B[:, None]
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    keep_BV &= mass_before_BV < top_p_B[:, None]
    keep_BV &= sorted_BV >= min_p_B[:, None] * sorted_BV[:, :1]
    keep_BV[:, 0] = True
    return torch.where(keep_BV, sorted_BV, torch.zeros_like(sorted_BV)), order_BV


def _inverse_cdf(probs_BV: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Per row, the first column whose cumulative probability exceeds u * total (u in [0, 1));
    a column with zero probability is never picked (rounding at the top falls back to the
    row's most likely column)."""
    cdf_BV = probs_BV.cumsum(dim=-1)
    u_B = host_tensor(uniforms, cdf_BV.dtype, cdf_BV.device)
    u_B1 = u_B[:, None] * cdf_BV[:, -1:]
    pick_B = torch.searchsorted(cdf_BV, u_B1, right=True)[:, 0].clamp_(max=probs_BV.shape[1] - 1)
    picked_B = probs_BV.gather(-1, pick_B[:, None])[:, 0]
    return torch.where(picked_B > 0, pick_B, probs_BV.argmax(dim=-1))


def sample_next(
    logits_BV: torch.Tensor,
    params: Sequence[SamplingParams],
    rngs: Sequence[random.Random],
) -> tuple[list[int], list[float]]:
    """Sample one token per row; returns (token ids, their logprobs as defined above)."""
    logits_BV = logits_BV.float()
    device = logits_BV.device
    temps_B = host_tensor(
        [1.0 if p.greedy else p.temperature for p in params], torch.float32, device
    )
    logp_BV = torch.log_softmax(logits_BV / temps_B[:, None], dim=-1)
    token_B = logits_BV.argmax(dim=-1)

    sampled = [b for b, p in enumerate(params) if not p.greedy]
    plain = [b for b in sampled if not params[b].truncates]
    truncated = [b for b in sampled if params[b].truncates]
    if plain:
        rows_R = host_tensor(plain, device=device)
        token_B[rows_R] = _inverse_cdf(logp_BV[rows_R].exp(), [rngs[b].random() for b in plain])
    if truncated:
        rows_R = host_tensor(truncated, device=device)
        kept_RV, order_RV = _filter_probs(logp_BV[rows_R].exp(), [params[b] for b in truncated])
        choice_R = _inverse_cdf(kept_RV, [rngs[b].random() for b in truncated])
        token_B[rows_R] = order_RV.gather(-1, choice_R[:, None])[:, 0]

    logprobs = logp_BV.gather(-1, token_B[:, None])[:, 0].tolist()
    return token_B.tolist(), logprobs
