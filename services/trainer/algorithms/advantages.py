"""Advantages per estimator: a group stage on scalar rewards, then a token stage.

Group stage (`group_rewards`, on the G x N rewards of G prompts with N samples each) gives
each sample the sequence-level reward the token stage starts from:
    grpo, gspo                     (r - mean(r)) / (std(r) + 1e-6)   std unbiased, as Miles
                                   (--disable-grpo-std-normalization: r - mean(r))
    reinforce_plus_plus_baseline   r - mean(r)
    reinforce_plus_plus, ppo       r
    on_policy_distillation         0  (the teacher's signal below is the whole advantage)

Token stage (`token_advantages`, on B samples x T response positions; mask_BT = 1 where a
token trains). Only trainable positions are steps: a masked token (a tool's output in a
multi-turn sample) carries no reward, no value, and no discount.
    grpo, gspo, ..._distillation   A_t = reward, on every token
    reinforce_plus_plus(_baseline) r_t = -kl_coef * kl_t (--use-kl-in-reward), plus the
                                   reward at the last trainable token;
                                   A_t = sum_{k >= t} gamma^(k - t) r_k, then whitened over
                                   the batch's trainable tokens
    ppo                            the same r_t; GAE with the critic's values V_t:
                                   delta_t = r_t + gamma V_{t+1} - V_t  (V after the end = 0)
                                   A_t = delta_t + gamma lambd A_{t+1};  returns = A + V
    --normalize-advantages         whiten any estimator's advantages over the batch
    on-policy distillation         A_t -= opd_kl_coef * (student_t - teacher_t), last, so the
                                   term keeps its scale (the estimator, or --use-opd on any)
Whitening: (A - mean) / sqrt(var + 1e-8), mean and (biased) var over the trainable tokens of
the whole batch; `sum_across_ranks` adds the sums of the other data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from millstream.common.config.algo import AlgoConfig

GRPO_EPS = 1e-6
WHITEN_EPS = 1e-8
WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")

SumFn = Callable[[torch.Tensor], torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t


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


def group_rewards(rewards_GN: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """The per-sample reward the token stage starts from (see the module docstring)."""
    estimator = cfg.advantage_estimator
    if estimator in ("grpo", "gspo"):
        return grpo_advantages(rewards_GN, normalize_std=not cfg.disable_grpo_std_normalization)
    if estimator == "reinforce_plus_plus_baseline":
        return rewards_GN - rewards_GN.mean(dim=-1, keepdim=True)
    if estimator == "on_policy_distillation":
        return torch.zeros_like(rewards_GN)
    if estimator in ("reinforce_plus_plus", "ppo"):
        return rewards_GN
    raise ValueError(f"unknown --advantage-estimator {estimator!r}")


def token_rewards(
    reward_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None, kl_coef: float
) -> torch.Tensor:
    """r_t: -kl_coef * kl_t on trainable tokens, plus the reward at the last trainable one
    (a sample with no trainable token gets none)."""
    rewards_BT = torch.zeros_like(mask_BT)
    if kl_BT is not None and kl_coef:
        rewards_BT = -kl_coef * kl_BT * mask_BT
    positions_BT = torch.arange(mask_BT.shape[1]).expand_as(mask_BT)
    last_B = torch.where(mask_BT > 0, positions_BT, -1).amax(dim=1)
    has_B = last_B >= 0
    rows_B = torch.arange(mask_BT.shape[0])[has_B]
    rewards_BT[rows_B, last_B[has_B]] += reward_B[has_B].to(rewards_BT.dtype)
    return rewards_BT


def discounted_returns(
    rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = r_t + gamma G_{next trainable}; 0 at masked positions."""
    running_B = torch.zeros(rewards_BT.shape[0], dtype=rewards_BT.dtype)
    returns_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        on_B = mask_BT[:, t] > 0
        running_B = torch.where(on_B, rewards_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B * on_B
    return returns_BT


def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BT, returns_BT) by GAE over the trainable positions; 0 where masked."""
    B, T = rewards_BT.shape
    next_value_B = torch.zeros(B, dtype=rewards_BT.dtype)
    running_B = torch.zeros(B, dtype=rewards_BT.dtype)
    adv_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(T)):
        on_B = mask_BT[:, t] > 0
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        running_B = torch.where(on_B, delta_B + gamma * lambd * running_B, running_B)
        next_value_B = torch.where(on_B, values_BT[:, t], next_value_B)
        adv_BT[:, t] = running_B * on_B
    return adv_BT, (adv_BT + values_BT) * mask_BT


def masked_whiten(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, sum_across_ranks: SumFn = _local
) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the trainable tokens of every rank; 0 where masked."""
    x64_BT, m64_BT = x_BT.double(), mask_BT.double()
    sums = sum_across_ranks(
        torch.stack([m64_BT.sum(), (x64_BT * m64_BT).sum(), (x64_BT.square() * m64_BT).sum()])
    )
    n = sums[0].clamp(min=1)
    mean = sums[1] / n
    var = (sums[2] / n - mean.square()).clamp(min=0)
    return ((x64_BT - mean) * torch.rsqrt(var + WHITEN_EPS) * m64_BT).to(x_BT.dtype)


def token_advantages(
    reward_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: AlgoConfig,
    *,
    kl_BT: torch.Tensor | None = None,
    values_BT: torch.Tensor | None = None,
    student_BT: torch.Tensor | None = None,
    teacher_BT: torch.Tensor | None = None,
    sum_across_ranks: SumFn = _local,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages_BT, returns_BT for the critic or None). `kl_BT` is the reward-side KL
    (old policy vs reference), `values_BT` the critic's values, `student_BT`/`teacher_BT` the
    logprobs for on-policy distillation."""
    estimator = cfg.advantage_estimator
    returns_BT = None
    kl_coef = cfg.kl_coef if cfg.use_kl_in_reward else 0.0
    if estimator in WHITENED:
        rewards_BT = token_rewards(reward_B, mask_BT, kl_BT, kl_coef)
        adv_BT = discounted_returns(rewards_BT, mask_BT, cfg.gamma)
    elif estimator == "ppo":
        if values_BT is None:
            raise ValueError("ppo needs the critic's values")
        rewards_BT = token_rewards(reward_B, mask_BT, kl_BT, kl_coef)
        adv_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, cfg.gamma, cfg.lambd)
    else:
        adv_BT = reward_B[:, None].to(mask_BT.dtype).expand_as(mask_BT) * mask_BT
    if estimator in WHITENED or cfg.normalize_advantages:
        adv_BT = masked_whiten(adv_BT, mask_BT, sum_across_ranks)
    if cfg.distills:
        if student_BT is None or teacher_BT is None:
            raise ValueError("on-policy distillation needs student and teacher logprobs")
        adv_BT = adv_BT - cfg.opd_kl_coef * (student_BT - teacher_BT) * mask_BT
    return adv_BT, returns_BT
