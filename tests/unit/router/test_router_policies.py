"""Router policies: least in-flight, round robin, cache-aware (affinity, threshold, imbalance)."""

from __future__ import annotations

from collections import Counter

import pytest

from millstream.router.policies import (
    CacheAware,
    LeastInflight,
    RoundRobin,
    make_policy,
    route_key,
)
from millstream.router.registry import Worker


def workers(*loads: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}:1", in_flight=load) for i, load in enumerate(loads)]


def test_least_inflight_picks_the_least_loaded():
    ws = workers(3, 1, 2)
    policy = LeastInflight()
    assert all(policy.choose(ws) is ws[1] for _ in range(5))


def test_least_inflight_breaks_ties_round_robin():
    ws = workers(0, 5, 0, 0)
    policy = LeastInflight()
    picks = [policy.choose(ws).url for _ in range(6)]
    assert picks == [ws[0].url, ws[2].url, ws[3].url] * 2


def test_round_robin_ignores_load():
    ws = workers(100, 0, 7)
    policy = RoundRobin()
    assert [policy.choose(ws) for _ in range(6)] == ws * 2


def test_make_policy_names():
    assert isinstance(make_policy("least_inflight"), LeastInflight)
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("cache_aware", cache_threshold=0.5), CacheAware)
    with pytest.raises(ValueError, match="bogus"):
        make_policy("bogus")


def test_cache_aware_sends_a_repeated_prefix_to_the_same_worker():
    ws = workers(0, 0, 0)
    policy = CacheAware(cache_threshold=0.5, block=4)
    prompts = [tuple(range(i * 100, i * 100 + 40)) for i in range(3)]
    first = [policy.choose(ws, p) for p in prompts]
    assert len({w.url for w in first}) == 3  # fresh prompts spread (least cached worker)
    for _ in range(3):
        for prompt, worker in zip(prompts, first, strict=True):
            assert policy.choose(ws, (*prompt, 7, 7, 7)) is worker  # same prefix, longer tail


def test_cache_aware_identical_short_prompts_stick_together():
    ws = workers(0, 0)
    policy = CacheAware(cache_threshold=0.5, block=16)
    chosen = {policy.choose(ws, "hello").url for _ in range(8)}  # shorter than one block
    assert len(chosen) == 1


def test_cache_aware_below_threshold_goes_to_least_loaded():
    ws = workers(0, 0)
    policy = CacheAware(cache_threshold=0.9, block=4)
    key = tuple(range(40))
    owner = policy.choose(ws, key)
    owner.in_flight = 3  # busier, but not imbalanced by the thresholds below
    other = next(w for w in ws if w is not owner)
    # 8 of 40 shared (two blocks): ratio 0.2 < 0.9 -> least loaded, not the owner
    assert policy.choose(ws, key[:8] + tuple(range(1000, 1032))) is other
    # the full key matches 40/40 -> owner despite its load
    assert policy.choose(ws, key) is owner


def test_cache_aware_imbalance_falls_back_to_least_inflight():
    ws = workers(0, 0)
    policy = CacheAware(
        cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=1.5, block=4
    )
    key = tuple(range(32))
    owner = policy.choose(ws, key)
    other = next(w for w in ws if w is not owner)
    owner.in_flight, other.in_flight = 10, 1  # spread 9 > 4 and 10 > 1.5 x 1: imbalanced
    assert policy.imbalanced(ws)
    assert policy.choose(ws, key) is other
    owner.in_flight, other.in_flight = 4, 1  # spread 3 <= 4: affinity wins again
    assert not policy.imbalanced(ws)
    assert policy.choose(ws, key) is owner
    owner.in_flight, other.in_flight = 30, 25  # spread 5 > 4 but 30 <= 1.5 x 25: balanced
    assert not policy.imbalanced(ws)
    assert policy.choose(ws, key) is owner


def test_cache_aware_only_considers_candidates_and_forgets_removed_workers():
    ws = workers(0, 0)
    policy = CacheAware(cache_threshold=0.5, block=4)
    key = tuple(range(20))
    owner = policy.choose(ws, key)
    other = next(w for w in ws if w is not owner)
    assert policy.choose([other], key) is other  # owner not eligible: no affinity to it
    policy.forget(owner)
    assert owner.id not in policy.match(key, ws)
    assert policy.match(key, ws) == {other.id: 20}


def test_cache_aware_evicts_least_recent_blocks():
    ws = workers(0)
    policy = CacheAware(block=4, max_blocks=10)
    for start in range(0, 400, 40):
        policy.choose(ws, tuple(range(start, start + 40)))
    assert policy.size == 10
    assert policy.match(tuple(range(0, 40)), ws) == {}  # the oldest prompt is gone
    assert policy.match(tuple(range(360, 400)), ws) == {ws[0].id: 40}


def test_route_key_reads_sglang_and_openai_bodies():
    assert route_key({"input_ids": [1, 2, 3]}) == (1, 2, 3)
    assert route_key({"input_ids": [[4, 5], [6]]}) == (4, 5)
    assert route_key({"text": "abc"}) == "abc"
    assert route_key({"text": ["first", "second"]}) == "first"
    assert route_key({"prompt": "p"}) == "p"
    assert route_key({"messages": [{"role": "user", "content": "hi"}, {"content": "!"}]}) == "hi!"
    assert route_key({"sampling_params": {}}) is None
    assert route_key([1, 2]) is None
    assert route_key({"input_ids": ["x"]}) is None


def test_least_inflight_spreads_a_burst_evenly():
    ws = workers(0, 0, 0, 0)
    policy = LeastInflight()
    counts: Counter[str] = Counter()
    for _ in range(40):
        w = policy.choose(ws)
        w.in_flight += 1
        counts[w.url] += 1
    assert set(counts.values()) == {10}
