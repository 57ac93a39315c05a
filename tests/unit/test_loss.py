"""The GRPO loss against an independent float64 reference written with plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from millstream.common.config.algo import AlgoConfig
from millstream.trainer.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from millstream.trainer.algorithms.loss import Denominator, approx_kl, policy_loss

# Two groups of three samples; response lengths 3, 2, 4 / 1, 3, 2 (padded to T=4).
REWARDS = [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
LENGTHS = [3, 2, 4, 1, 3, 2]


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    old = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.8
    rollout = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.4
    ref = logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64)
    return logp, old, rollout, ref, entropy, mask


def _ref_advantages(normalize: bool) -> list[float]:
    out = []
    for group in REWARDS:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + 1e-6) if normalize else r - mean for r in group]
    return out


def _ref_loss(cfg: AlgoConfig, logp, old, rollout, ref, entropy, adv) -> float:
    """Plain-Python float64 reference of loss.py's docstring formulas."""
    eps_hi = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    per_sample, token_sum, n_tokens = [], 0.0, 0
    for i, n in enumerate(LENGTHS):
        terms = []
        for t in range(n):
            lp, o, a = logp[i][t], old[i][t], adv[i]
            ratio = math.exp(lp - o)
            pg = max(-a * ratio, -a * min(max(ratio, 1 - cfg.eps_clip), 1 + eps_hi))
            if cfg.eps_clip_c is not None and a < 0:
                pg = min(pg, -a * cfg.eps_clip_c)
            if cfg.use_tis:
                pg *= min(max(math.exp(o - rollout[i][t]), cfg.tis_clip_low), cfg.tis_clip_high)
            lr = lp - ref[i][t]
            kl = {"k1": lr, "k2": lr * lr / 2, "k3": math.exp(-lr) - 1 + lr}.get(cfg.kl_loss_type)
            if kl is None:
                kl = min(max(math.exp(-lr) - 1 + lr, -10), 10)
            term = (
                pg
                - cfg.entropy_coef * entropy[i][t]
                + (cfg.kl_loss_coef if cfg.use_kl_loss else 0) * kl
            )
            terms.append(term)
        per_sample.append(sum(terms) / n)
        token_sum += sum(terms)
        n_tokens += n
    return (
        token_sum / n_tokens if cfg.calculate_per_token_loss else sum(per_sample) / len(per_sample)
    )


def test_grpo_advantages_match_reference():
    for normalize in (True, False):
        got = (
            grpo_advantages(torch.tensor(REWARDS, dtype=torch.float64), normalize)
            .flatten()
            .tolist()
        )
        assert got == pytest.approx(_ref_advantages(normalize), abs=1e-12)


def test_grpo_all_equal_group_has_zero_advantage():
    assert grpo_advantages(torch.ones(1, 4, dtype=torch.float64)).abs().max() == 0


CONFIGS = {
    "clip": AlgoConfig(),
    "asym_clip_dual": AlgoConfig(eps_clip=0.1, eps_clip_high=0.28, eps_clip_c=3.0),
    "kl_low_var_entropy": AlgoConfig(
        use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01
    ),
    "kl_k2_per_token": AlgoConfig(
        use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k2", calculate_per_token_loss=True
    ),
    "tis": AlgoConfig(use_tis=True, tis_clip_low=0.5, tis_clip_high=1.2),
    "k1_k3": AlgoConfig(use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k3"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_policy_loss_matches_float64_reference(name):
    cfg = CONFIGS[name]
    logp, old, rollout, ref, entropy, mask = _batch()
    adv_B = torch.tensor(_ref_advantages(True), dtype=torch.float64)
    loss, metrics = policy_loss(
        logp, old, broadcast_to_tokens(adv_B, mask), mask, cfg,
        Denominator(n_samples=len(LENGTHS), n_tokens=int(mask.sum())),
        rollout_logp_BT=rollout, ref_logp_BT=ref, entropy_BT=entropy,
    )  # fmt: skip
    expected = _ref_loss(
        cfg,
        logp.tolist(),
        old.tolist(),
        rollout.tolist(),
        ref.tolist(),
        entropy.tolist(),
        adv_B.tolist(),
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert 0 <= metrics["pg_clipfrac"] <= 1


@pytest.mark.parametrize("per_token", [False, True])
def test_micro_batches_sum_to_the_whole_batch_gradient(per_token):
    cfg = AlgoConfig(
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        calculate_per_token_loss=per_token,
    )
    logp, old, _rollout, ref, _entropy, mask = _batch(seed=3)
    adv = broadcast_to_tokens(torch.tensor(_ref_advantages(True), dtype=torch.float64), mask)
    denom = Denominator(n_samples=len(LENGTHS), n_tokens=int(mask.sum()))

    whole = logp.clone().requires_grad_()
    policy_loss(whole, old, adv, mask, cfg, denom, ref_logp_BT=ref)[0].backward()

    split = logp.clone().requires_grad_()
    for rows in ([0, 1], [2], [3, 4, 5]):
        policy_loss(
            split[rows], old[rows], adv[rows], mask[rows], cfg, denom, ref_logp_BT=ref[rows]
        )[0].backward()
    torch.testing.assert_close(split.grad, whole.grad, rtol=1e-12, atol=1e-15)


def test_ratio_is_one_when_old_equals_current():
    logp, _, _, _, _, mask = _batch()
    adv = broadcast_to_tokens(torch.ones(len(LENGTHS), dtype=torch.float64), mask)
    _, metrics = policy_loss(
        logp, logp.clone(), adv, mask, AlgoConfig(), Denominator(len(LENGTHS), int(mask.sum()))
    )
    assert metrics["ppo_kl"] == 0 and metrics["pg_clipfrac"] == 0
    assert metrics["pg_loss"] == pytest.approx(-1.0)


def test_kl_kinds_and_unknown_kind():
    lr = torch.tensor([0.3, -0.2], dtype=torch.float64)
    zero = torch.zeros(2, dtype=torch.float64)
    assert torch.allclose(approx_kl(lr, zero, "k2"), lr.square() / 2)
    big = torch.tensor([-20.0], dtype=torch.float64)
    assert approx_kl(big, torch.zeros(1, dtype=torch.float64), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="kl-loss-type"):
        approx_kl(lr, zero, "k7")
