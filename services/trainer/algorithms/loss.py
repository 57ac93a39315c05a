"""The policy-gradient loss with its regularisers, and how it is reduced over a batch.

Per token (B samples x T response positions; mask_BT = 1 where a token trains):
    log_ratio  = logp - old_logp                             old_logp: the policy before step 1
               gspo: the sample's masked mean of it, on each of its tokens (sequence ratio)
    ratio      = exp(log_ratio)
    pg         = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))
    dual clip  (--eps-clip-c c, A < 0):  pg = min(pg, -A * c)
    TIS        (--use-tis; w = exp(old_logp - rollout_logp), the train/rollout mismatch,
                with the log clamped to +-20 against overflow; old_logp is the trainer's
                even with --use-rollout-logprobs, which makes rollout_logp the ratio's):
                 tis:    pg *= clip(w, tis_clip_low, tis_clip)
                 icepop: pg *= w inside [tis_clip_low, tis_clip], 0 outside
                 --custom-tis-function-path: the user's function weights pg and may
                 reject tokens: mask_BT' (tis.py); every term's numerator counts mask_BT'
                 tokens, its denominator stays mask_BT's (Miles' decoupled IS/rejection)
    kl         (to the reference, logr = logp - ref_logp):
                 k1 = logr,  k2 = logr^2 / 2,  k3 = exp(-logr) - 1 + logr,
                 low_var_kl = clip(k3 with logr clamped to +-20, -10, 10)
    loss = reduce(pg) - entropy_coef * reduce(entropy) + kl_loss_coef * reduce(kl)
The critic (ppo), values V against the old values V_old and the returns R:
    value_loss = reduce(0.5 * max((V - R)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - R)^2))
Metrics beside the losses: tis (mean w before clipping), tis_clipfrac (tokens whose weight is
not w), train_rollout_logprob_abs_diff (|old_logp - rollout_logp|), train_rollout_kl
(rollout_logp - old_logp: a KL(rollout || train) estimate), ess_ratio (per sample
(sum w)^2 / (n sum w^2) over its n trainable tokens: 1 when train and rollout agree).

Reduction over the GLOBAL batch, so micro-batches and data-parallel ranks add up to exactly
the gradient of the whole batch in one piece (m' = m unless a TIS function rejects tokens):
    per-sample mean (default):        sum_i (sum_t x_it m'_it / sum_t m_it) / n_samples_global
    --calculate-per-token-loss:       sum_i sum_t x_it m'_it / n_tokens_global
A micro-batch passes the global counts as `denom`; summing its losses gives the batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from millstream.common.config.algo import AlgoConfig

from .tis import CustomTis

LOW_VAR_KL_CLAMP = 10.0
LOG_RATIO_CLAMP = 20.0


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
    if kind == "k3":
        return torch.exp(-log_ratio_BT) - 1 + log_ratio_BT
    if kind == "low_var_kl":
        log_ratio_BT = log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl_BT = torch.exp(-log_ratio_BT) - 1 + log_ratio_BT
        return kl_BT.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown --kl-loss-type {kind!r} (k1, k2, k3, low_var_kl)")


def masked_reduce(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    denom: Denominator,
    per_token: bool,
    count_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """`count_BT`: the mask whose per-sample sums divide (default `mask_BT`)."""
    if per_token:
        return (x_BT * mask_BT).sum() / denom.n_tokens
    return per_sample_mean(x_BT, mask_BT, count_BT).sum() / denom.n_samples


def per_sample_mean(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, count_BT: torch.Tensor | None = None
) -> torch.Tensor:
    count_BT = mask_BT if count_BT is None else count_BT
    return (x_BT * mask_BT).sum(-1) / count_BT.sum(-1).clamp(min=1)


def clipped_pg(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: AlgoConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pg_BT, clipped_BT as 0/1, ppo_kl_BT) for the PPO-style clipped surrogate."""
    ppo_kl_BT = old_logp_BT - logp_BT
    if cfg.advantage_estimator == "gspo":
        ppo_kl_BT = per_sample_mean(ppo_kl_BT, mask_BT)[:, None].expand_as(ppo_kl_BT)
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
    scored_logp_BT: torch.Tensor | None = None,
    custom_tis: CustomTis | None = None,
    lengths: tuple[list[int], list[int]] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's share of the batch loss, and its share of each metric.
    `scored_logp_BT`: the trainer's old logprobs, where `old_logp_BT` is not them
    (--use-rollout-logprobs); `custom_tis` with `lengths` (each sample's response and total
    tokens): the user's TIS function (module docstring)."""
    per_token = cfg.calculate_per_token_loss

    def reduce(x_BT: torch.Tensor) -> torch.Tensor:
        return masked_reduce(x_BT, mask_BT, denom, per_token)

    pg_BT, clipfrac_BT, ppo_kl_BT = clipped_pg(logp_BT, old_logp_BT, adv_BT, mask_BT, cfg)
    metrics: dict[str, float] = {}
    keep_BT = mask_BT
    if rollout_logp_BT is not None:
        scored_BT = (old_logp_BT if scored_logp_BT is None else scored_logp_BT).detach()
        diff_BT = scored_BT - rollout_logp_BT.detach()
        w_BT = torch.exp(diff_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        metrics["train_rollout_logprob_abs_diff"] = reduce(diff_BT.abs()).item()
        metrics["train_rollout_kl"] = reduce(-diff_BT).item()
        metrics["ess_ratio"] = reduce_per_sample(
            ess_ratio(w_BT, mask_BT), mask_BT, denom, per_token
        )
        if cfg.use_tis and custom_tis is not None:
            assert lengths is not None, "a TIS function needs the samples' lengths"
            out = custom_tis(pg_BT, scored_BT, rollout_logp_BT, mask_BT, *lengths)
            pg_BT, keep_BT = out.pg_BT, out.keep_BT * mask_BT
            for name, x_BT in out.metrics_BT.items():
                metrics[f"train/{name}"] = reduce(x_BT).item()
        elif cfg.use_tis:
            weight_BT = tis_weights(w_BT, cfg)
            pg_BT = pg_BT * weight_BT
            metrics["tis"] = reduce(w_BT).item()
            metrics["tis_clipfrac"] = reduce((weight_BT != w_BT).to(pg_BT.dtype)).item()

    def reduce_kept(x_BT: torch.Tensor) -> torch.Tensor:
        return masked_reduce(x_BT, keep_BT, denom, per_token, count_BT=mask_BT)

    pg_loss = reduce_kept(pg_BT)
    loss = pg_loss
    metrics |= {
        "pg_loss": pg_loss.item(),
        "pg_clipfrac": reduce_kept(clipfrac_BT).item(),
        "ppo_kl": reduce_kept(ppo_kl_BT.detach()).item(),
    }
    if entropy_BT is not None:
        entropy = reduce_kept(entropy_BT)
        metrics["entropy_loss"] = entropy.item()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * entropy
    if ref_logp_BT is not None:
        kl = reduce_kept(approx_kl(logp_BT, ref_logp_BT, cfg.kl_loss_type))
        metrics["kl_loss"] = kl.item()
        if cfg.use_kl_loss and cfg.kl_loss_coef:
            loss = loss + cfg.kl_loss_coef * kl
    return loss, metrics


def tis_weights(w_BT: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """The weight on each token's pg term from the train/rollout ratio w (--tis-mode)."""
    if cfg.tis_mode == "icepop":
        inside_BT = (w_BT >= cfg.tis_clip_low) & (w_BT <= cfg.tis_clip)
        return torch.where(inside_BT, w_BT, torch.zeros_like(w_BT))
    return w_BT.clamp(cfg.tis_clip_low, cfg.tis_clip)


def ess_ratio(w_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per sample: (sum w)^2 / (n * sum w^2) over its n trainable tokens (1 if none)."""
    sum_w_B = (w_BT * mask_BT).sum(-1)
    sum_w2_B = (w_BT.square() * mask_BT).sum(-1)
    n_B = mask_BT.sum(-1)
    return torch.where(n_B > 0, sum_w_B.square() / (n_B * sum_w2_B).clamp(min=1e-30), 1.0)


def reduce_per_sample(
    x_B: torch.Tensor, mask_BT: torch.Tensor, denom: Denominator, per_token: bool
) -> float:
    """A per-sample value reduced like the loss: weighted by its tokens under per-token loss."""
    if per_token:
        return float((x_B * mask_BT.sum(-1)).sum() / denom.n_tokens)
    return float(x_B.sum() / denom.n_samples)


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: AlgoConfig,
    denom: Denominator,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped value loss (micro-batch share) and its metrics."""
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-cfg.value_clip, cfg.value_clip)
    surr1_BT = (values_BT - returns_BT).square()
    surr2_BT = (clipped_BT - returns_BT).square()
    loss_BT = 0.5 * torch.maximum(surr1_BT, surr2_BT)
    per_token = cfg.calculate_per_token_loss
    loss = masked_reduce(loss_BT, mask_BT, denom, per_token)
    clipfrac = masked_reduce((surr2_BT > surr1_BT).to(loss_BT.dtype), mask_BT, denom, per_token)
    return loss, {"value_loss": loss.item(), "value_clipfrac": clipfrac.item()}
