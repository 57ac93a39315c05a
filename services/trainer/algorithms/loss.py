"""The policy-gradient loss with its regularisers, and how it is reduced over a batch.

Per token (B samples x T response positions; mask_BT = 1 where a token trains):
    ratio      = exp(logp - old_logp)                        old_logp: the policy before step 1
    pg         = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
    dual clip  (--eps-clip-c c, A < 0):  pg = min(pg, -A * c)
    TIS        (--use-tis):  pg *= clip(exp(old_logp - rollout_logp), tis_clip_low, tis_clip_high)
    kl         (to the reference, logr = logp - ref_logp):
                 k1 = logr,  k2 = logr^2 / 2,  k3 = exp(-logr) - 1 + logr,
                 low_var_kl = clip(k3, -10, 10)
    loss = reduce(pg) - entropy_coef * reduce(entropy) + kl_loss_coef * reduce(kl)

Reduction over the GLOBAL batch, so micro-batches and data-parallel ranks add up to exactly
the gradient of the whole batch in one piece:
    per-sample mean (default):        sum_i (sum_t x_it m_it / sum_t m_it) / n_samples_global
    --calculate-per-token-loss:       sum_i sum_t x_it m_it / n_tokens_global
A micro-batch passes the global counts as `denom`; summing its losses gives the batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from millstream.common.config.algo import AlgoConfig

LOW_VAR_KL_CLAMP = 10.0


@dataclass(frozen=True)
class Denominator:
    """The global batch's counts that every micro-batch divides by."""

    n_samples: int
    n_tokens: int


def approx_kl(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str) -> torch.Tensor:
    log_ratio_BT = logp_BT - ref_logp_BT
    if kind == "k1":
        return log_ratio_BT
    if kind == "k2":
        return log_ratio_BT.square() / 2
    if kind in ("k3", "low_var_kl"):
        kl_BT = torch.exp(-log_ratio_BT) - 1 + log_ratio_BT
        return kl_BT.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP) if kind == "low_var_kl" else kl_BT
    raise ValueError(f"unknown --kl-loss-type {kind!r} (k1, k2, k3, low_var_kl)")


def masked_reduce(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, denom: Denominator, per_token: bool
) -> torch.Tensor:
    if per_token:
        return (x_BT * mask_BT).sum() / denom.n_tokens
    per_sample_B = (x_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    return per_sample_B.sum() / denom.n_samples


def clipped_pg(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor, cfg: AlgoConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pg_BT, clipped_BT as 0/1, ppo_kl_BT) for the PPO-style clipped surrogate."""
    ppo_kl_BT = old_logp_BT - logp_BT
    ratio_BT = torch.exp(-ppo_kl_BT)
    eps_high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1 - cfg.eps_clip, 1 + eps_high)
    pg_BT = torch.maximum(unclipped_BT, clipped_BT)
    clipfrac_BT = (clipped_BT > unclipped_BT).to(logp_BT.dtype)
    if cfg.eps_clip_c is not None:
        dual_BT = torch.minimum(pg_BT, -adv_BT * cfg.eps_clip_c)
        pg_BT = torch.where(adv_BT < 0, dual_BT, pg_BT)
    return pg_BT, clipfrac_BT, ppo_kl_BT


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: AlgoConfig,
    denom: Denominator,
    *,
    rollout_logp_BT: torch.Tensor | None = None,
    ref_logp_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's share of the batch loss, and its share of each metric."""
    per_token = cfg.calculate_per_token_loss

    def reduce(x_BT: torch.Tensor) -> torch.Tensor:
        return masked_reduce(x_BT, mask_BT, denom, per_token)

    pg_BT, clipfrac_BT, ppo_kl_BT = clipped_pg(logp_BT, old_logp_BT, adv_BT, cfg)
    metrics: dict[str, float] = {}
    if rollout_logp_BT is not None:
        diff_BT = (old_logp_BT - rollout_logp_BT).detach()
        metrics["train_rollout_logprob_abs_diff"] = reduce(diff_BT.abs()).item()
        if cfg.use_tis:
            tis_raw_BT = torch.exp(diff_BT)
            tis_BT = tis_raw_BT.clamp(cfg.tis_clip_low, cfg.tis_clip_high)
            pg_BT = pg_BT * tis_BT
            metrics["tis"] = reduce(tis_BT).item()
            metrics["tis_clipfrac"] = reduce((tis_raw_BT != tis_BT).to(pg_BT.dtype)).item()
    pg_loss = reduce(pg_BT)
    loss = pg_loss
    metrics |= {
        "pg_loss": pg_loss.item(),
        "pg_clipfrac": reduce(clipfrac_BT).item(),
        "ppo_kl": reduce(ppo_kl_BT.detach()).item(),
    }
    if entropy_BT is not None:
        entropy = reduce(entropy_BT)
        metrics["entropy_loss"] = entropy.item()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
    if ref_logp_BT is not None:
        kl = reduce(approx_kl(logp_BT, ref_logp_BT, cfg.kl_loss_type))
        metrics["kl_loss"] = kl.item()
        if cfg.use_kl_loss and cfg.kl_loss_coef:
            loss = loss + cfg.kl_loss_coef * kl
    return loss, metrics
