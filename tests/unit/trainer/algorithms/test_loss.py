"""The policy and value losses against independent float64 references written with plain Python
loops: GRPO/GSPO ratios, clipping, TIS/icepop, KL, entropy, both reductions, their metrics, and
the gradient wrt logp (derived by hand), and micro-batch / data-parallel splits adding up."""

from __future__ import annotations

import math

import pytest
import torch

from millstream.common.config.algo import AlgoConfig
from millstream.trainer.algorithms.advantages import grpo_advantages
from millstream.trainer.algorithms.loss import Denominator, approx_kl, policy_loss, value_loss

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


def broadcast_to_tokens(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return adv_B[:, None].expand_as(mask_BT).clone()


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
                pg *= min(max(math.exp(o - rollout[i][t]), cfg.tis_clip_low), cfg.tis_clip)
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
    "tis": AlgoConfig(use_tis=True, tis_clip_low=0.5, tis_clip=1.2),
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


# A hand-made batch with tokens masked in the middle (1, 0, 1) and padding; masked positions hold
# values that would change every result if they leaked in. Per token: OLD, LOGP - OLD, OLD -
# ROLLOUT (log of the TIS ratio w; 0.30, -0.40, 0.25, -0.30 put w outside [0.8, 1.25]),
# LOGP - REF (-3.0 saturates low_var_kl), entropy, and a token-varying advantage (as from ppo).
MASK = [[1, 0, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 1, 0], [1, 0, 0, 0, 0]]
OLD = [
    [-1.2, -0.5, -0.8, -2.0, 0.0],
    [-0.3, -1.5, 0.0, 0.0, 0.0],
    [-0.9, -0.4, -1.1, -0.2, -1.7],
    [-2.2, -3.0, 0.0, -0.6, 0.0],
    [-0.7, 0.0, 0.0, 0.0, 0.0],
]
LOG_RATIO = [
    [0.35, 4.0, -0.05, 0.10, 0.0],
    [-0.30, 0.12, 0.0, 0.0, 0.0],
    [0.05, -0.15, 0.40, -0.02, 0.08],
    [-0.45, 2.5, 0.0, 0.20, 0.0],
    [0.15, 0.0, 0.0, 0.0, 0.0],
]
LOG_W = [
    [0.30, 1.0, -0.05, 0.10, 0.0],
    [-0.40, 0.02, 0.0, 0.0, 0.0],
    [0.0, 0.15, -0.10, 0.25, -0.30],
    [0.05, -2.0, 0.0, -0.12, 0.0],
    [0.20, 0.0, 0.0, 0.0, 0.0],
]
LOG_REF = [
    [0.1, -0.2, 0.3, -3.0, 0.0],
    [0.05, -0.1, 0.0, 0.0, 0.0],
    [0.2, 0.0, -0.15, 0.4, -0.05],
    [-0.3, 0.5, 0.0, 0.1, 0.0],
    [0.25, 0.0, 0.0, 0.0, 0.0],
]
ENTROPY = [
    [0.9, 5.0, 1.4, 0.2, 0.0],
    [1.1, 0.6, 0.0, 0.0, 0.0],
    [0.3, 0.8, 1.9, 0.5, 1.0],
    [0.7, 5.0, 0.0, 1.6, 0.0],
    [1.2, 0.0, 0.0, 0.0, 0.0],
]
ADV_TOKENS = [
    [1.0, 9.0, 0.5, -0.3, 0.0],
    [-0.8, -1.1, 0.0, 0.0, 0.0],
    [0.4, 0.6, 1.3, -0.2, 0.9],
    [-1.2, 9.0, 0.0, -0.5, 0.0],
    [-0.7, 0.0, 0.0, 0.0, 0.0],
]
ADV_SAMPLES = [1.0, -0.5, 0.8, -1.2, -0.7]


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _masked_batch(per_sample_adv: bool) -> dict[str, torch.Tensor]:
    old = _t(OLD)
    logp = old + _t(LOG_RATIO)
    adv = [[a] * len(MASK[0]) for a in ADV_SAMPLES] if per_sample_adv else ADV_TOKENS
    return {
        "logp": logp,
        "old": old,
        "rollout": old - _t(LOG_W),
        "ref": logp - _t(LOG_REF),
        "entropy": _t(ENTROPY),
        "adv": _t(adv),
        "mask": _t(MASK),
    }


def _denom(mask) -> Denominator:
    return Denominator(n_samples=len(mask), n_tokens=int(sum(sum(row) for row in mask)))


def _ref_kl(lr: float, kind: str) -> tuple[float, float]:
    """(kl, d kl / d logp) for logr = logp - ref_logp."""
    if kind == "k1":
        return lr, 1.0
    if kind == "k2":
        return lr * lr / 2, lr
    k3 = math.exp(-lr) - 1 + lr
    if kind == "k3":
        return k3, 1 - math.exp(-lr)
    lr_c = min(max(lr, -20.0), 20.0)
    k3_c = math.exp(-lr_c) - 1 + lr_c
    inside = -20 < lr < 20 and -10 < k3_c < 10
    return min(max(k3_c, -10.0), 10.0), (1 - math.exp(-lr_c)) if inside else 0.0


def _ref_policy(cfg: AlgoConfig, b: dict[str, list[list[float]]]):
    """(loss, metrics, d loss / d logp as B x T lists), float64, from loss.py's docstring, with
    the gradient derived by hand: d pg / d ratio is -A on the unclipped branch and 0 where the
    clip or the dual clip is the one that counts; gspo's ratio moves each trainable token's
    logp by 1/n of the sample's log-ratio."""
    logp, old, rollout, ref, entropy, adv, mask = (
        b[k] for k in ("logp", "old", "rollout", "ref", "entropy", "adv", "mask")
    )
    B, T = len(mask), len(mask[0])
    n = [sum(row) for row in mask]
    N = sum(n)
    trainable = [(i, t) for i in range(B) for t in range(T) if mask[i][t]]

    def weight(i: int) -> float:
        return 1 / N if cfg.calculate_per_token_loss else 1 / (n[i] * B)

    def reduce(x: dict) -> float:
        return sum(weight(i) * x[i, t] for i, t in trainable)

    gspo = cfg.advantage_estimator == "gspo"
    seq_lr = [
        sum(logp[i][t] - old[i][t] for t in range(T) if mask[i][t]) / max(n[i], 1) for i in range(B)
    ]
    eps_hi = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    kl_coef = cfg.kl_loss_coef if cfg.use_kl_loss else 0.0
    pg, dpg, clipped, ppo_kl, w, applied, kl, dkl = ({} for _ in range(8))
    dual = 0
    for i, t in trainable:
        log_ratio = seq_lr[i] if gspo else logp[i][t] - old[i][t]
        ratio, a = math.exp(log_ratio), adv[i][t]
        unclipped_term = -a * ratio
        clipped_term = -a * min(max(ratio, 1 - cfg.eps_clip), 1 + eps_hi)
        pg[i, t] = max(unclipped_term, clipped_term)
        dpg[i, t] = -a * ratio if unclipped_term >= clipped_term else 0.0
        clipped[i, t] = 1.0 if clipped_term > unclipped_term else 0.0
        if cfg.eps_clip_c is not None and a < 0 and pg[i, t] > -a * cfg.eps_clip_c:
            pg[i, t], dpg[i, t] = -a * cfg.eps_clip_c, 0.0
            dual += 1
        ppo_kl[i, t] = -log_ratio
        w[i, t] = math.exp(old[i][t] - rollout[i][t])
        lo, hi = cfg.tis_clip_low, cfg.tis_clip
        if not cfg.use_tis:
            applied[i, t] = 1.0
        elif cfg.tis_mode == "icepop":
            applied[i, t] = w[i, t] if lo <= w[i, t] <= hi else 0.0
        else:
            applied[i, t] = min(max(w[i, t], lo), hi)
        pg[i, t] *= applied[i, t]
        dpg[i, t] *= applied[i, t]
        kl[i, t], dkl[i, t] = _ref_kl(logp[i][t] - ref[i][t], cfg.kl_loss_type)

    grad = [[0.0] * T for _ in range(B)]
    for i, t in trainable:
        share = weight(i) * dpg[i, t]
        if gspo:
            for t2 in range(T):
                grad[i][t2] += mask[i][t2] * share / n[i]
        else:
            grad[i][t] += share
        grad[i][t] += weight(i) * kl_coef * dkl[i, t]

    ent = {(i, t): entropy[i][t] for i, t in trainable}
    ess = [
        sum(w[i, t] for t in range(T) if mask[i][t]) ** 2
        / (n[i] * sum(w[i, t] ** 2 for t in range(T) if mask[i][t]))
        for i in range(B)
    ]
    metrics = {
        "pg_loss": reduce(pg),
        "pg_clipfrac": reduce(clipped),
        "ppo_kl": reduce(ppo_kl),
        "entropy_loss": reduce(ent),
        "kl_loss": reduce(kl),
        "train_rollout_logprob_abs_diff": reduce({k: abs(math.log(v)) for k, v in w.items()}),
        "train_rollout_kl": reduce({k: -math.log(v) for k, v in w.items()}),
        "ess_ratio": sum(
            e * (n[i] / N if cfg.calculate_per_token_loss else 1 / B) for i, e in enumerate(ess)
        ),
    }
    if cfg.use_tis:
        metrics["tis"] = reduce(w)
        metrics["tis_clipfrac"] = reduce({k: float(applied[k] != w[k]) for k in w})
    loss = metrics["pg_loss"] - cfg.entropy_coef * metrics["entropy_loss"]
    loss += kl_coef * metrics["kl_loss"]
    coverage = {"clipped": sum(clipped.values()), "dual": dual, "applied": applied, "w": w}
    return loss, metrics, grad, coverage


def _run_policy(cfg: AlgoConfig, batch: dict[str, torch.Tensor], rows=None, denom=None):
    rows = list(range(len(MASK))) if rows is None else rows
    b = {k: v[rows] for k, v in batch.items()}
    return policy_loss(
        b["logp"], b["old"], b["adv"], b["mask"], cfg, denom or _denom(MASK),
        rollout_logp_BT=b["rollout"], ref_logp_BT=b["ref"], entropy_BT=b["entropy"],
    )  # fmt: skip


def _algo(name: str, per_token: bool) -> tuple[AlgoConfig, bool]:
    """(config, whether the advantage is per sample) for each named case."""
    common = {"calculate_per_token_loss": per_token, "entropy_coef": 0.01}
    tis = {"use_tis": True, "tis_clip_low": 0.8, "tis_clip": 1.25}
    return {
        "gspo": (AlgoConfig(advantage_estimator="gspo", eps_clip=0.1, **common), True),
        "gspo_dual_kl": (
            AlgoConfig(
                advantage_estimator="gspo", eps_clip=0.1, eps_clip_high=0.12, eps_clip_c=1.1,
                use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k3", **common,
            ),
            True,
        ),
        "gspo_icepop": (
            AlgoConfig(advantage_estimator="gspo", eps_clip=0.1, tis_mode="icepop", **tis, **common),
            True,
        ),
        "icepop": (
            AlgoConfig(
                tis_mode="icepop", eps_clip=0.2, eps_clip_high=0.28, use_kl_loss=True,
                kl_loss_coef=0.1, kl_loss_type="low_var_kl", **tis, **common,
            ),
            False,
        ),
        "icepop_dual": (
            AlgoConfig(tis_mode="icepop", eps_clip_c=1.1, **tis, **common), False
        ),
        "tis_clamp_k2": (
            AlgoConfig(use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="k2", **tis, **common),
            False,
        ),
        "plain_k1": (
            AlgoConfig(use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k1", **common), False
        ),
    }[name]  # fmt: skip


CASES = ["gspo", "gspo_dual_kl", "gspo_icepop", "icepop", "icepop_dual", "tis_clamp_k2", "plain_k1"]


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("name", CASES)
def test_loss_metrics_and_grad_match_reference_on_masked_batch(name, per_token):
    cfg, per_sample_adv = _algo(name, per_token)
    batch = _masked_batch(per_sample_adv)
    logp = batch["logp"].clone().requires_grad_()
    loss, metrics = _run_policy(cfg, batch | {"logp": logp})
    loss.backward()
    ref_loss, ref_metrics, ref_grad, coverage = _ref_policy(
        cfg, {k: v.tolist() for k, v in batch.items()}
    )
    assert coverage["clipped"] > 0, "the batch should clip some tokens"
    assert (coverage["dual"] > 0) == (cfg.eps_clip_c is not None)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    assert set(metrics) == set(ref_metrics)
    for key, want in ref_metrics.items():
        assert metrics[key] == pytest.approx(want, rel=1e-12, abs=1e-14), key
    torch.testing.assert_close(logp.grad, _t(ref_grad), rtol=1e-12, atol=1e-14)
    assert (logp.grad * (1 - batch["mask"])).abs().max() == 0


def test_masked_batch_puts_tis_ratios_on_both_sides_of_the_range():
    cfg, _ = _algo("icepop", False)
    *_, coverage = _ref_policy(cfg, {k: v.tolist() for k, v in _masked_batch(False).items()})
    ws = list(coverage["w"].values())
    assert any(v < 0.8 for v in ws) and any(v > 1.25 for v in ws)
    assert any(0.8 <= v <= 1.25 for v in ws)
    assert sum(a == 0 for a in coverage["applied"].values()) == sum(
        not 0.8 <= v <= 1.25 for v in ws
    )


def test_icepop_metrics_by_hand_on_one_sample():
    """One sample, tokens 1, 0 (masked), 1: w = e^0.3, -, e^-0.1 with range [0.8, 1.25]."""
    w0, w2 = math.exp(0.3), math.exp(-0.1)
    old = _t([[-1.0, -1.0, -1.0]])
    cfg = AlgoConfig(use_tis=True, tis_mode="icepop", tis_clip_low=0.8, tis_clip=1.25)
    _, metrics = policy_loss(
        old.clone(), old, _t([[1.0, 1.0, 1.0]]), _t([[1, 0, 1]]), cfg, Denominator(1, 2),
        rollout_logp_BT=old - _t([[0.3, 5.0, -0.1]]),
    )  # fmt: skip
    assert metrics["pg_loss"] == pytest.approx(-(0 + w2) / 2, rel=1e-12)
    assert metrics["tis"] == pytest.approx((w0 + w2) / 2, rel=1e-12)
    assert metrics["tis_clipfrac"] == pytest.approx(0.5, rel=1e-12)
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(0.2, rel=1e-12)
    assert metrics["train_rollout_kl"] == pytest.approx(-0.1, rel=1e-12)
    assert metrics["ess_ratio"] == pytest.approx((w0 + w2) ** 2 / (2 * (w0**2 + w2**2)))


@pytest.mark.parametrize("low, high", [(1.0, 2.0), (0.5, 1.0)])
def test_icepop_range_is_closed(low, high):
    """w = exp(0) = 1 exactly sits on an edge of the range: kept, not zeroed."""
    old = _t([[-1.0, -1.0]])
    cfg = AlgoConfig(use_tis=True, tis_mode="icepop", tis_clip_low=low, tis_clip=high)
    _, metrics = policy_loss(
        old.clone(), old, _t([[1.0, 1.0]]), _t([[1, 1]]), cfg, Denominator(1, 2),
        rollout_logp_BT=old - _t([[0.0, 3.0]]),
    )  # fmt: skip
    assert metrics["pg_loss"] == pytest.approx(-0.5, rel=1e-12)
    assert metrics["tis_clipfrac"] == pytest.approx(0.5, rel=1e-12)


SPLITS = {
    "micro_batches": [[0, 1], [2], [3, 4]],
    "ranks_then_micro_batches": [[0, 3], [2], [1, 4]],
    "one_row_each": [[4], [3], [2], [1], [0]],
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("name", ["gspo_dual_kl", "gspo_icepop", "icepop", "icepop_dual"])
def test_splits_with_the_global_denominator_add_up_to_the_whole_batch(name, per_token, split):
    """Micro-batches (and data-parallel ranks, whose gradients the all-reduce sums) each divide
    by the global Denominator: their gradients and metric shares add up to the whole batch's."""
    cfg, per_sample_adv = _algo(name, per_token)
    batch = _masked_batch(per_sample_adv)
    whole = batch["logp"].clone().requires_grad_()
    whole_loss, whole_metrics = _run_policy(cfg, batch | {"logp": whole})
    whole_loss.backward()

    parts = batch["logp"].clone().requires_grad_()
    total_loss, total_metrics = 0.0, dict.fromkeys(whole_metrics, 0.0)
    for rows in SPLITS[split]:
        loss, metrics = _run_policy(cfg, batch | {"logp": parts}, rows=rows)
        loss.backward()
        total_loss += loss.item()
        for key, value in metrics.items():
            total_metrics[key] += value
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-12, atol=1e-15)
    assert total_loss == pytest.approx(whole_loss.item(), rel=1e-12, abs=1e-15)
    for key, value in whole_metrics.items():
        assert total_metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_ratio_is_exactly_one_when_old_equals_current(estimator, per_token):
    cfg = AlgoConfig(advantage_estimator=estimator, calculate_per_token_loss=per_token)
    batch = _masked_batch(per_sample_adv=True)
    logp = batch["logp"].clone().requires_grad_()
    loss, metrics = policy_loss(
        logp, batch["logp"].clone(), batch["adv"], batch["mask"], cfg, _denom(MASK)
    )
    assert metrics["ppo_kl"] == 0 and metrics["pg_clipfrac"] == 0
    n = [sum(row) for row in MASK]
    if per_token:
        want = -sum(a * k for a, k in zip(ADV_SAMPLES, n, strict=True)) / sum(n)
    else:
        want = -sum(ADV_SAMPLES) / len(ADV_SAMPLES)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    loss.backward()
    # At ratio 1 the gradient is -A times the token's reduction weight (gspo: shared equally).
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            w_tok = 1 / sum(n) if per_token else 1 / (n[i] * len(MASK))
            assert logp.grad[i, t].item() == pytest.approx(-ADV_SAMPLES[i] * w_tok * m, rel=1e-12)


# The critic: V, V_old, returns on the masked layout; |V - V_old| > 0.2 on some tokens, where
# the clipped prediction is sometimes the farther one (counted in value_clipfrac).
VALUES = [
    [0.5, 9.0, 0.9, -0.2, 0.0],
    [1.0, 0.3, 0.0, 0.0, 0.0],
    [0.1, 0.7, -0.4, 0.25, 0.6],
    [0.8, -9.0, 0.0, 0.0, 0.0],
    [-0.5, 0.0, 0.0, 0.0, 0.0],
]
OLD_VALUES = [
    [0.2, 0.0, 1.0, 0.3, 0.0],
    [1.05, 0.0, 0.0, 0.0, 0.0],
    [0.5, 0.6, -0.1, 0.2, 0.1],
    [0.3, 0.0, 0.0, 0.5, 0.0],
    [-0.1, 0.0, 0.0, 0.0, 0.0],
]
RETURNS = [
    [0.4, 3.0, 1.2, 0.6, 0.0],
    [0.9, 0.2, 0.0, 0.0, 0.0],
    [0.7, 0.65, -0.9, -0.3, 1.0],
    [1.0, 2.0, 0.0, 0.1, 0.0],
    [0.2, 0.0, 0.0, 0.0, 0.0],
]


def _ref_value(cfg: AlgoConfig, rows: list[int]):
    """(value_loss, value_clipfrac, d loss / d V) in float64 for the given rows."""
    mask = [MASK[i] for i in rows]
    n = [sum(row) for row in MASK]
    N = sum(n)
    loss, clipfrac, grad = 0.0, 0.0, [[0.0] * len(MASK[0]) for _ in rows]
    for k, i in enumerate(rows):
        for t, m in enumerate(mask[k]):
            if not m:
                continue
            v, v_old, r, c = VALUES[i][t], OLD_VALUES[i][t], RETURNS[i][t], cfg.value_clip
            v_clip = v_old + min(max(v - v_old, -c), c)
            surr1, surr2 = (v - r) ** 2, (v_clip - r) ** 2
            weight = 1 / N if cfg.calculate_per_token_loss else 1 / (n[i] * len(MASK))
            loss += weight * 0.5 * max(surr1, surr2)
            clipfrac += weight * (surr2 > surr1)
            grad[k][t] = weight * ((v - r) if surr1 >= surr2 else 0.0)
    return loss, clipfrac, grad


@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample", "per_token"])
def test_value_loss_matches_reference(per_token):
    cfg = AlgoConfig(advantage_estimator="ppo", value_clip=0.2, calculate_per_token_loss=per_token)
    values = _t(VALUES).requires_grad_()
    loss, metrics = value_loss(values, _t(OLD_VALUES), _t(RETURNS), _t(MASK), cfg, _denom(MASK))
    loss.backward()
    ref_loss, ref_clipfrac, ref_grad = _ref_value(cfg, list(range(len(MASK))))
    assert 0 < ref_clipfrac < 1
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    assert metrics["value_loss"] == pytest.approx(ref_loss, rel=1e-12)
    assert metrics["value_clipfrac"] == pytest.approx(ref_clipfrac, rel=1e-12)
    torch.testing.assert_close(values.grad, _t(ref_grad), rtol=1e-12, atol=1e-15)

    total = sum(
        value_loss(
            _t(VALUES)[rows], _t(OLD_VALUES)[rows], _t(RETURNS)[rows], _t(MASK)[rows], cfg,
            _denom(MASK),
        )[0].item()
        for rows in SPLITS["ranks_then_micro_batches"]
    )  # fmt: skip
    assert total == pytest.approx(ref_loss, rel=1e-12)
