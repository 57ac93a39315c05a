"""sample_next: greedy, truncation filters, per-row generators, and the logprob definition."""

from __future__ import annotations

import torch

from millstream.engine.sampling import SamplingParams, sample_next


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


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


def test_each_row_draws_with_its_own_generator():
    logits_BV = torch.zeros(4, 100)
    params = [SamplingParams()] * 4
    alone, _ = sample_next(logits_BV[:1], params[:1], [torch.Generator().manual_seed(42)])
    batch_gens = gens(4, seed=7)
    batch_gens[2] = torch.Generator().manual_seed(42)
    together, _ = sample_next(logits_BV, params, batch_gens)
    assert together[2] == alone[0]


def test_sampling_follows_the_tempered_distribution():
    logits_V = torch.tensor([1.0, 0.0, -1.0])
    params = SamplingParams(temperature=2.0)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        tokens, _ = sample_next(logits_V[None], [params], [generator])
        counts[tokens[0]] += 1
    assert torch.allclose(counts / 3000, torch.softmax(logits_V / 2.0, -1), atol=0.03)
