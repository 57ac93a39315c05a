"""Custom reward functions and filters for the reward tests (`--custom-rm-path tests.support...`),
with Miles' signatures: a reward is `fn(args, sample)` (with --group-rm `fn(args, samples)`), a
dynamic-sampling filter `fn(args, samples, **kwargs)`; `sample` is millstream.compat.miles.Sample.

Each misbehaves only for samples whose label asks for it ("boom", "hang", "flaky"), so one
run config can carry good and bad groups and a test can check that the worker goes on.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from typing import Any

from millstream.compat.miles import Sample

_lock = threading.Lock()
_flaky_seen: set[tuple[str, int]] = set()


def spread(args: Any, sample: Sample) -> float:
    """A reward that tells any two different responses apart (a hash of the text in [0, 1)):
    on the random tiny model, where no answer is right, GRPO's advantages are non-zero
    whenever a group's responses differ, so a run's weights move."""
    return zlib.crc32(sample.response.encode()) % 1000 / 1000


def exact_sync(args: Any, sample: Sample) -> float:
    return 1.0 if sample.response.strip() == sample.label.strip() else 0.0


async def exact_async(args: Any, sample: Sample) -> float:
    await asyncio.sleep(0)
    return exact_sync(args, sample)


def dict_reward(args: Any, sample: Sample) -> dict[str, float]:
    """A dict reward; --reward-key acc picks 'acc'."""
    return {"acc": exact_sync(args, sample), "len": float(len(sample.response))}


def group_reward(args: Any, samples: list[Sample], **kwargs: Any) -> list[float]:
    """A group reward: the rank of each response's length within the group."""
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].response), i))
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def group_reward_wrong_length(args: Any, samples: list[Sample], **kwargs: Any) -> list[float]:
    return [1.0]


def misbehaving(args: Any, sample: Sample) -> float:
    """label "boom": raises; "hang": sleeps past any test timeout; "nan": returns NaN;
    "flaky": fails on the first attempt for each sample, then succeeds; anything else: exact
    match."""
    if sample.label == "boom":
        raise RuntimeError(f"reward exploded on {sample.response!r}")
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
    return exact_sync(args, sample)


async def hangs_async(args: Any, sample: Sample) -> float:
    if sample.label == "hang":
        await asyncio.sleep(30)
    return exact_sync(args, sample)


def returns_nan(args: Any, sample: Sample) -> float:
    return float("nan")


def slow_exact(args: Any, sample: Sample) -> float:
    """Exact match after a short sleep, so a killed worker has work in flight."""
    time.sleep(0.15)
    return exact_sync(args, sample)


def keep_if_any_correct(args: Any, samples: list[Sample], **kwargs: Any) -> dict[str, Any]:
    keep = any(s.reward > 0 for s in samples)
    return {"keep": keep, "reason": None if keep else "no sample is correct"}


def filter_raises(args: Any, samples: list[Sample], **kwargs: Any) -> bool:
    raise ValueError("filter bug")
