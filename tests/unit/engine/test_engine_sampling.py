"""sample_next: greedy, truncation filters, per-row RNGs, and the logprob definition."""

from __future__ import annotations

import random

import torch

from millstream.engine.sampling import SamplingParams, sample_next


def gens(n: int, seed: int = 0) -> list[random.Random]:
    return [random.Random(seed + i) for i in range(n)]


def test_greedy_takes_the_argmax_and_reports_the_temperature_1_logprob():
    logits_BV = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]])
    tokens, logprobs = sample_next(logits_BV, [SamplingParams(temperature=0.0)] * 2, gens(2))
    assert tokens == [1, 0]
    expected = torch.log_softmax(logits_BV, -1)[[0, 1], [1, 0]]
    assert torch.allclose(torch.tensor(logprobs), expected)


def test_logprob_is_taken_before_truncation_at_the_request_temperature():
    logits_BV = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.05)
    tokens, logprobs = sample_next(logits_BV, [params], gens(1))
    assert tokens[0] in logits_BV[0].topk(3).indices.tolist()
    expected = torch.log_softmax(logits_BV[0] / 0.5, -1)[tokens[0]]
    assert abs(logprobs[0] - float(expected)) < 1e-6


def test_filters_that_keep_one_token_are_greedy():
    logits_BV = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)]
    for seed in range(5):
        tokens, _ = sample_next(logits_BV, params, gens(3, seed))
        assert tokens == logits_BV.argmax(-1).tolist()


def test_top_k_and_top_p_only_ever_pick_surviving_tokens():
    logits_V = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    probs_V = torch.softmax(logits_V, -1)
    top_p = float(probs_V[:2].sum()) - 1e-4  # the first two tokens reach it
    picked = set()
    for seed in range(200):
        tokens, _ = sample_next(logits_V[None], [SamplingParams(top_p=top_p)], gens(1, seed))
        picked.add(tokens[0])
    assert picked == {0, 1}
    picked.clear()
    for seed in range(200):
        tokens, _ = sample_next(logits_V[None], [SamplingParams(top_k=3)], gens(1, seed))
        picked.add(tokens[0])
    assert picked == {0, 1, 2}


def test_each_row_draws_with_its_own_rng():
    logits_BV = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(), SamplingParams(top_k=20), SamplingParams(), SamplingParams()]
    for seed in range(20):
        alone, _ = sample_next(logits_BV[2:3], params[2:3], [random.Random(seed)])
        batch_rngs = gens(4, seed=1000 + seed)
        batch_rngs[2] = random.Random(seed)
        together, _ = sample_next(logits_BV, params, batch_rngs)
        assert together[2] == alone[0]


def test_a_zero_probability_token_is_never_sampled():
    logits_BV = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]] * 64)
    params = [SamplingParams(), SamplingParams(top_k=2)] * 32
    rngs = gens(64)
    for rng in rngs[:8]:  # u at the very top of [0, 1): rounding must not reach column 3
        rng.random = lambda: 1.0 - 2**-53
    for _ in range(20):
        tokens, logprobs = sample_next(logits_BV, params, rngs)
        assert set(tokens) <= {0, 2}
        assert all(abs(lp - torch.log(torch.tensor(0.5)).item()) < 1e-6 for lp in logprobs)


def test_sampling_follows_the_tempered_distribution():
    logits_V = torch.tensor([1.0, 0.0, -1.0])
    params = SamplingParams(temperature=2.0)
    rng = random.Random(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        tokens, _ = sample_next(logits_V[None], [params], [rng])
        counts[tokens[0]] += 1
    assert torch.allclose(counts / 3000, torch.softmax(logits_V / 2.0, -1), atol=0.03)
