"""Advantages per sample, broadcast over its response tokens.

GRPO (Shao et al. 2024), per group of n samples of one prompt:
    A_i = (r_i - mean(r)) / (std(r) + 1e-6)        std unbiased, as torch.std and Miles
    --disable-grpo-std-normalization:  A_i = r_i - mean(r)
Every response token of sample i gets A_i; the loss mask decides which tokens train.
Other estimators (GSPO, REINFORCE++, PPO/GAE, on-policy distillation) slot in beside this
with the same signature.
"""

from __future__ import annotations

import torch

GRPO_EPS = 1e-6


def grpo_advantages(rewards_GN: torch.Tensor, normalize_std: bool = True) -> torch.Tensor:
    """rewards_GN: G groups x N samples -> advantages_GN."""
    centered_GN = rewards_GN - rewards_GN.mean(dim=-1, keepdim=True)
    if not normalize_std:
        return centered_GN
    if rewards_GN.shape[-1] < 2:
        raise ValueError(
            "GRPO std normalization needs n_samples_per_prompt >= 2 (or --disable-grpo-std-normalization)"
        )
    return centered_GN / (rewards_GN.std(dim=-1, keepdim=True) + GRPO_EPS)


def broadcast_to_tokens(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-sample advantage on every token position (masked positions carry it too; the mask decides)."""
    return adv_B[:, None].to(mask_BT.dtype).expand_as(mask_BT).clone()
