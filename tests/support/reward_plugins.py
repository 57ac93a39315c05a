"""Custom reward functions and filters for the reward tests (`--custom-rm-path tests.support...`).

Each misbehaves only for samples whose label asks for it ("boom", "hang", "flaky"), so one
run config can carry good and bad groups and a test can check that the worker goes on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from millstream.common.types import Sample

_lock = threading.Lock()
_flaky_seen: set[tuple[str, int]] = set()


def exact_sync(sample: Sample, cfg: Any) -> float:
    return 1.0 if sample.response_text.strip() == sample.label.strip() else 0.0


async def exact_async(sample: Sample, cfg: Any) -> float:
    await asyncio.sleep(0)
    return exact_sync(sample, cfg)


def dict_reward(sample: Sample, cfg: Any) -> dict[str, float]:
    """A dict reward; --reward-key acc picks 'acc'."""
    return {"acc": exact_sync(sample, cfg), "len": float(len(sample.response_text))}


def group_reward(samples: list[Sample], cfg: Any) -> list[float]:
    """A group reward: the rank of each response's length within the group."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].response_text), i))
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def group_reward_wrong_length(samples: list[Sample], cfg: Any) -> list[float]:
    return [1.0]


def misbehaving(sample: Sample, cfg: Any) -> float:
    """label "boom": raises; "hang": sleeps past any test timeout; "nan": returns NaN;
    "flaky": fails on the first attempt for each sample, then succeeds; anything else: exact
    match."""
    if sample.label == "boom":
        raise RuntimeError(f"reward exploded on {sample.response_text!r}")
    if sample.label == "nan":
        return float("nan")
    if sample.label == "hang":
        time.sleep(30)
    if sample.label == "flaky":
        key = (sample.group_id, sample.index)
        with _lock:
            first = key not in _flaky_seen
            _flaky_seen.add(key)
        if first:
            raise ConnectionError("flaky verifier: first attempt fails")
        return 1.0
    return exact_sync(sample, cfg)


async def hangs_async(sample: Sample, cfg: Any) -> float:
    if sample.label == "hang":
        await asyncio.sleep(30)
    return exact_sync(sample, cfg)


def returns_nan(sample: Sample, cfg: Any) -> float:
    return float("nan")


def slow_exact(sample: Sample, cfg: Any) -> float:
    """Exact match after a short sleep, so a killed worker has work in flight."""
    time.sleep(0.15)
    return exact_sync(sample, cfg)


def keep_if_any_correct(samples: list[Sample], cfg: Any) -> dict[str, Any]:
    keep = any(s.reward > 0 for s in samples)
    return {"keep": keep, "reason": None if keep else "no sample is correct"}


def filter_raises(samples: list[Sample], cfg: Any) -> bool:
    raise ValueError("filter bug")
