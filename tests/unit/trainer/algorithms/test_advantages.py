"""Advantages per estimator against an independent float64 reference written with plain Python
loops: the group stage on the G x N rewards, and the token stage (KL in the reward, discounted
returns and GAE over trainable positions only, whitening over the batch and across ranks,
on-policy distillation last)."""

from __future__ import annotations

import math

import pytest
import torch

from millstream.common.config.algo import ESTIMATORS, AlgoConfig
from millstream.trainer.algorithms.advantages import (
    group_rewards,
    masked_whiten,
    token_advantages,
    token_rewards,
)

TEACHER_URL = "http://teacher.invalid"

# Four samples of different lengths; sample 0 has a masked token in the middle (a tool's
# output) and padding, sample 3 starts with a masked token. Masked positions hold values that
# would change every result if they leaked in.
MASK = [[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 1, 0, 1, 1]]
REWARD = [1.0, -0.5, 2.0, 0.3]
KL = [
    [0.2, -0.1, 7.0, 0.4, 7.0],
    [0.05, 0.3, -0.2, 0.1, 0.25],
    [0.6, 7.0, 7.0, 7.0, 7.0],
    [7.0, -0.3, 7.0, 0.15, 0.5],
]
VALUES = [
    [0.4, 0.6, 9.0, 0.8, 9.0],
    [-0.2, 0.1, 0.0, -0.3, -0.4],
    [1.5, 9.0, 9.0, 9.0, 9.0],
    [9.0, 0.2, 9.0, 0.25, 0.35],
]
STUDENT = [
    [-0.5, -1.2, -9.0, -0.3, -9.0],
    [-2.0, -0.1, -0.7, -1.5, -0.9],
    [-0.4, -9.0, -9.0, -9.0, -9.0],
    [-9.0, -0.8, -9.0, -1.1, -0.6],
]
TEACHER = [
    [-0.7, -0.9, -1.0, -0.3, -1.0],
    [-1.5, -0.4, -0.6, -1.9, -1.2],
    [-0.5, -1.0, -1.0, -1.0, -1.0],
    [-1.0, -0.5, -1.0, -1.4, -0.2],
]


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def _positions(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m]


def _ref_group(rewards: list[list[float]], estimator: str, disable_std: bool = False):
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        if estimator in ("grpo", "gspo"):
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
            out.append([(r - mean) if disable_std else (r - mean) / (std + 1e-6) for r in group])
        elif estimator == "reinforce_plus_plus_baseline":
            out.append([r - mean for r in group])
        elif estimator == "on_policy_distillation":
            out.append([0.0 for _ in group])
        else:
            out.append(list(group))
    return out


def _ref_token_rewards(reward, mask, kl, kl_coef):
    out = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        pos = _positions(row)
        for t in pos:
            out[i][t] = -kl_coef * kl[i][t] if kl_coef else 0.0
        if pos:
            out[i][pos[-1]] += reward[i]
    return out


def _ref_discounted(rewards, mask, gamma):
    out = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        running = 0.0
        for t in reversed(_positions(row)):
            running = rewards[i][t] + gamma * running
            out[i][t] = running
    return out


def _ref_gae(rewards, values, mask, gamma, lambd):
    adv = [[0.0] * len(row) for row in mask]
    ret = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        next_value, running = 0.0, 0.0
        for t in reversed(_positions(row)):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            running = delta + gamma * lambd * running
            next_value = values[i][t]
            adv[i][t] = running
            ret[i][t] = running + values[i][t]
    return adv, ret


def _ref_sums(x, mask) -> list[float]:
    """[count, sum, sum of squares] over the trainable tokens: one rank's whitening stats."""
    xs = [x[i][t] for i, row in enumerate(mask) for t in _positions(row)]
    return [float(len(xs)), sum(xs), sum(v * v for v in xs)]


def _ref_whiten(x, mask, other=(0.0, 0.0, 0.0)):
    """Two-pass mean and biased variance over this batch's trainable tokens plus another rank's
    `other` sums (count, sum, sum of squares)."""
    xs = [x[i][t] for i, row in enumerate(mask) for t in _positions(row)]
    n = len(xs) + other[0]
    mean = (sum(xs) + other[1]) / n
    var = (
        sum((v - mean) ** 2 for v in xs) + other[2] - 2 * mean * other[1] + other[0] * mean**2
    ) / n
    out = [[0.0] * len(row) for row in mask]
    for i, row in enumerate(mask):
        for t in _positions(row):
            out[i][t] = (x[i][t] - mean) / math.sqrt(var + 1e-8)
    return out


def _ref_raw(cfg: AlgoConfig, reward, mask, kl=KL, values=VALUES):
    """(advantages before whitening, returns or None, whether to whiten) per the docstring."""
    kl_coef = cfg.kl_coef if cfg.use_kl_in_reward else 0.0
    est = cfg.advantage_estimator
    if est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        rewards = _ref_token_rewards(reward, mask, kl, kl_coef)
        return _ref_discounted(rewards, mask, cfg.gamma), None, True
    if est == "ppo":
        rewards = _ref_token_rewards(reward, mask, kl, kl_coef)
        adv, ret = _ref_gae(rewards, values, mask, cfg.gamma, cfg.lambd)
        return adv, ret, cfg.normalize_advantages
    adv = [[reward[i] if m else 0.0 for m in row] for i, row in enumerate(mask)]
    return adv, None, cfg.normalize_advantages


def _ref_advantages(cfg: AlgoConfig, reward, mask, other=(0.0, 0.0, 0.0), **inputs):
    adv, ret, whiten = _ref_raw(cfg, reward, mask, **inputs)
    if whiten:
        adv = _ref_whiten(adv, mask, other)
    if cfg.use_opd or cfg.advantage_estimator == "on_policy_distillation":
        for i, row in enumerate(mask):
            for t in _positions(row):
                adv[i][t] -= cfg.opd_kl_coef * (STUDENT[i][t] - TEACHER[i][t])
    return adv, ret


def _call(cfg: AlgoConfig, rows: list[int], reward=REWARD, sum_across_ranks=None):
    """token_advantages on `rows`, always given every optional input: flags that are off must
    ignore them."""
    extra = {} if sum_across_ranks is None else {"sum_across_ranks": sum_across_ranks}
    return token_advantages(
        _t(reward)[rows], _t(MASK)[rows], cfg, kl_BT=_t(KL)[rows], values_BT=_t(VALUES)[rows],
        student_BT=_t(STUDENT)[rows], teacher_BT=_t(TEACHER)[rows], **extra,
    )  # fmt: skip


def _check(got: torch.Tensor | None, want) -> None:
    if want is None:
        assert got is None
        return
    torch.testing.assert_close(got, _t(want), rtol=1e-12, atol=1e-12)


ALL = list(range(len(MASK)))
OPD = {"use_opd": True, "opd_teacher_url": TEACHER_URL}
RPP = "reinforce_plus_plus"
CASES = {
    "rpp_gamma1": AlgoConfig(advantage_estimator=RPP),
    "rpp_gamma09": AlgoConfig(advantage_estimator=RPP, gamma=0.9),
    "rpp_gamma1_kl": AlgoConfig(advantage_estimator=RPP, use_kl_in_reward=True, kl_coef=0.1),
    "rpp_gamma09_kl": AlgoConfig(
        advantage_estimator=RPP, gamma=0.9, use_kl_in_reward=True, kl_coef=0.05
    ),
    "rpp_gamma0_kl": AlgoConfig(
        advantage_estimator=RPP, gamma=0.0, use_kl_in_reward=True, kl_coef=0.2
    ),
    "rpp_normalize_whitens_once": AlgoConfig(
        advantage_estimator=RPP, gamma=0.9, normalize_advantages=True
    ),
    "rpp_kl_flag_without_coef": AlgoConfig(advantage_estimator=RPP, use_kl_in_reward=True),
    "rppb_gamma09_kl": AlgoConfig(
        advantage_estimator="reinforce_plus_plus_baseline", gamma=0.9, use_kl_in_reward=True,
        kl_coef=0.1,
    ),
    "ppo": AlgoConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8),
    "ppo_gamma1_lambd1": AlgoConfig(advantage_estimator="ppo"),
    "ppo_kl": AlgoConfig(
        advantage_estimator="ppo", gamma=0.95, lambd=0.7, use_kl_in_reward=True, kl_coef=0.1
    ),
    "ppo_normalize": AlgoConfig(
        advantage_estimator="ppo", gamma=0.9, lambd=0.8, normalize_advantages=True
    ),
    "grpo": AlgoConfig(),
    "gspo": AlgoConfig(advantage_estimator="gspo"),
    "grpo_normalize": AlgoConfig(normalize_advantages=True),
    "gspo_normalize": AlgoConfig(advantage_estimator="gspo", normalize_advantages=True),
    "opd_on_grpo_normalize": AlgoConfig(normalize_advantages=True, opd_kl_coef=0.5, **OPD),
    "opd_on_ppo": AlgoConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8, opd_kl_coef=2.0, **OPD),
    "opd_on_ppo_normalize": AlgoConfig(
        advantage_estimator="ppo", gamma=0.9, lambd=0.8, normalize_advantages=True, **OPD
    ),
    "opd_on_rpp_kl": AlgoConfig(
        advantage_estimator=RPP, use_kl_in_reward=True, kl_coef=0.1, opd_kl_coef=0.3, **OPD
    ),
    "opd_estimator": AlgoConfig(
        advantage_estimator="on_policy_distillation", opd_kl_coef=0.7, opd_teacher_url=TEACHER_URL
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_token_advantages_match_reference(name):
    cfg = CASES[name]
    adv, ret = _call(cfg, ALL)
    want_adv, want_ret = _ref_advantages(cfg, REWARD, MASK)
    _check(adv, want_adv)
    _check(ret, want_ret)
    assert (adv * (1 - _t(MASK))).abs().max() == 0


GROUP_REWARDS = [[1.0, 0.0, 0.5, 0.25], [0.0, 0.0, 1.0, -1.0], [0.3, 0.3, 0.3, 0.3]]


@pytest.mark.parametrize("disable_std", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_rewards_match_reference(estimator, disable_std):
    teacher = {"opd_teacher_url": TEACHER_URL} if estimator == "on_policy_distillation" else {}
    cfg = AlgoConfig(
        advantage_estimator=estimator, disable_grpo_std_normalization=disable_std, **teacher
    )
    got = group_rewards(_t(GROUP_REWARDS), cfg)
    _check(got, _ref_group(GROUP_REWARDS, estimator, disable_std))


def test_group_rewards_by_hand():
    """Group [1, 0, 0.5, 0.25]: mean 0.4375, unbiased std sqrt(0.546875 / 3)."""
    std = math.sqrt(0.546875 / 3)
    got = group_rewards(_t([[1.0, 0.0, 0.5, 0.25]]), AlgoConfig())
    want = [(r - 0.4375) / (std + 1e-6) for r in (1.0, 0.0, 0.5, 0.25)]
    assert got[0].tolist() == pytest.approx(want, rel=1e-12)


def test_grpo_std_needs_two_samples_unless_disabled():
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        group_rewards(_t([[1.0], [0.0]]), AlgoConfig())
    got = group_rewards(_t([[1.0], [0.0]]), AlgoConfig(disable_grpo_std_normalization=True))
    assert got.abs().max() == 0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_group_then_token_stage(estimator):
    """The whole pipeline: G=2 prompts x N=2 samples -> group stage -> token stage."""
    kl = {"use_kl_in_reward": True, "kl_coef": 0.1} if estimator in (RPP, RPP + "_baseline") else {}
    teacher = {"opd_teacher_url": TEACHER_URL} if estimator == "on_policy_distillation" else {}
    cfg = AlgoConfig(advantage_estimator=estimator, gamma=0.9, lambd=0.8, **kl, **teacher)
    rewards_GN = [REWARD[:2], REWARD[2:]]
    reward_B = group_rewards(_t(rewards_GN), cfg).reshape(-1)
    adv, ret = token_advantages(
        reward_B, _t(MASK), cfg, kl_BT=_t(KL), values_BT=_t(VALUES), student_BT=_t(STUDENT),
        teacher_BT=_t(TEACHER),
    )  # fmt: skip
    group = _ref_group(rewards_GN, estimator)
    want_adv, want_ret = _ref_advantages(cfg, group[0] + group[1], MASK)
    _check(adv, want_adv)
    _check(ret, want_ret)


def test_discounting_skips_masked_tokens_by_hand():
    """Mask 1, 0, 1, reward 1 at the last trainable token, gamma 0.5: returns 0.5, -, 1
    (one discount step across the masked token), whitened to -1, 0, 1 (var 1/16)."""
    cfg = AlgoConfig(advantage_estimator=RPP, gamma=0.5)
    adv, ret = token_advantages(_t([1.0]), _t([[1, 0, 1, 0]]), cfg)
    scale = 0.25 / math.sqrt(0.0625 + 1e-8)
    assert adv[0].tolist() == pytest.approx([-scale, 0.0, scale, 0.0], rel=1e-12)
    assert ret is None


def test_gae_skips_masked_tokens_by_hand():
    """Mask 1, 0, 1; V = 0.5, (9), 0.2; reward 1; gamma 0.9, lambd 0.8:
    t=2: delta = 1 - 0.2 = 0.8 = A;  t=0: delta = 0.9 * 0.2 - 0.5 = -0.32,
    A = -0.32 + 0.72 * 0.8 = 0.256;  returns = A + V = 0.756, 0, 1.0."""
    cfg = AlgoConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8)
    adv, ret = token_advantages(_t([1.0]), _t([[1, 0, 1]]), cfg, values_BT=_t([[0.5, 9.0, 0.2]]))
    assert adv[0].tolist() == pytest.approx([0.256, 0.0, 0.8], rel=1e-12)
    assert ret[0].tolist() == pytest.approx([0.756, 0.0, 1.0], rel=1e-12)


def test_kl_in_reward_by_hand():
    """Mask 1, 0, 1, 1; kl 0.2, (5), -0.1, 0.4; kl_coef 0.5; reward 1; gamma 1:
    r = -0.1, -, 0.05, 0.8 -> returns 0.75, -, 0.85, 0.8."""
    reward_BT = token_rewards(
        _t([1.0]), _t([[1, 0, 1, 1]]), _t([[0.2, 5.0, -0.1, 0.4]]), kl_coef=0.5
    )
    assert reward_BT[0].tolist() == pytest.approx([-0.1, 0.0, 0.05, 0.8], rel=1e-12)
    cfg = AlgoConfig(advantage_estimator="ppo", use_kl_in_reward=True, kl_coef=0.5)
    _, ret = token_advantages(
        _t([1.0]), _t([[1, 0, 1, 1]]), cfg, kl_BT=_t([[0.2, 5.0, -0.1, 0.4]]),
        values_BT=torch.zeros(1, 4, dtype=torch.float64),
    )  # fmt: skip
    assert ret[0].tolist() == pytest.approx([0.75, 0.0, 0.85, 0.8], rel=1e-12)


@pytest.mark.parametrize("name", ["rpp_gamma09_kl", "ppo_kl", "grpo"])
def test_a_sample_with_no_trainable_token_gets_nothing(name):
    """An all-masked row (reward 5) gets no reward and zero advantage, and leaves the others'
    whitening as it was without it."""
    cfg = CASES[name]
    mask = [*MASK, [0, 0, 0, 0, 0]]
    reward = [*REWARD, 5.0]
    kl_coef = cfg.kl_coef if cfg.use_kl_in_reward else 0.0
    reward_BT = token_rewards(_t(reward), _t(mask), _t([*KL, [1.0] * 5]), kl_coef)
    assert reward_BT[-1].abs().max() == 0
    _check(reward_BT[:-1], _ref_token_rewards(REWARD, MASK, KL, kl_coef))
    adv, ret = token_advantages(
        _t(reward), _t(mask), cfg, kl_BT=_t([*KL, [1.0] * 5]), values_BT=_t([*VALUES, [2.0] * 5])
    )
    assert adv[-1].abs().max() == 0
    want_adv, want_ret = _ref_advantages(cfg, REWARD, MASK)
    _check(adv[:-1], want_adv)
    if ret is not None:
        assert ret[-1].abs().max() == 0
        _check(ret[:-1], want_ret)


HALVES = ([0, 1], [2, 3])


@pytest.mark.parametrize(
    "name",
    [
        "rpp_gamma09_kl",
        "rppb_gamma09_kl",
        "ppo_normalize",
        "grpo_normalize",
        "opd_on_ppo_normalize",
    ],
)
def test_whitening_across_data_parallel_ranks(name):
    """Each rank whitens with the other rank's [count, sum, sum of squares] added in: the two
    halves give exactly the whole batch's advantages (and the reference's)."""
    cfg = CASES[name]
    whole_adv, whole_ret = _call(cfg, ALL)
    for mine, theirs in (HALVES, HALVES[::-1]):
        raw, _, _ = _ref_raw(
            cfg, [REWARD[i] for i in theirs], [MASK[i] for i in theirs],
            kl=[KL[i] for i in theirs], values=[VALUES[i] for i in theirs],
        )  # fmt: skip
        other = _ref_sums(raw, [MASK[i] for i in theirs])
        calls = []

        def add_other(local: torch.Tensor, other=other, calls=calls) -> torch.Tensor:
            calls.append(local.clone())
            return local + _t(other)

        adv, ret = _call(cfg, mine, sum_across_ranks=add_other)
        assert len(calls) == 1 and calls[0].shape == (3,)
        torch.testing.assert_close(adv, whole_adv[mine], rtol=1e-12, atol=1e-12)
        want = _ref_advantages(cfg, REWARD, MASK)[0]
        _check(adv, [want[i] for i in mine])
        if whole_ret is not None:
            torch.testing.assert_close(ret, whole_ret[mine], rtol=1e-12, atol=1e-12)


def test_masked_whiten_directly():
    x = [[1.0, 50.0, 3.0], [-2.0, 0.5, 50.0]]
    mask = [[1, 0, 1], [1, 1, 0]]
    _check(masked_whiten(_t(x), _t(mask)), _ref_whiten(x, mask))
    other_x, other_mask = [[4.0, -1.0, 2.5]], [[1, 1, 0]]
    other = _ref_sums(other_x, other_mask)
    got = masked_whiten(_t(x), _t(mask), lambda local: local + _t(other))
    whole = _ref_whiten(x + other_x, mask + other_mask)
    _check(got, whole[:2])
    constant = masked_whiten(_t([[2.0, 2.0, 7.0]]), _t([[1, 1, 0]]))
    assert constant.abs().max() < 1e-6
