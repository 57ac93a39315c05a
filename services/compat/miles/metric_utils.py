"""Stand-in for Miles' `miles.utils.metric_utils`: the helpers Miles' log functions use.

Miles' default rollout log function (miles/ray/rollout/metrics.py), and the custom ones users
copy from it, build their log dict with these: `dict_add_prefix`, `compute_statistics` (mean,
median, max, min), `compute_pass_rate` (pass@1, 2, 4, ... up to the group size, a sample
passing with reward 1, the unbiased estimator), `has_repetition` (the last 10,000 characters
compress more than 10x) and `compute_rollout_step` (the rollout id, or the train step with
--wandb-always-use-train-step). Same names, arguments and values as Miles'; pure Python.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = [
    "compression_ratio",
    "compute_pass_rate",
    "compute_rollout_step",
    "compute_statistics",
    "dict_add_prefix",
    "has_repetition",
]


def dict_add_prefix(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {f"{prefix}{k}": v for k, v in d.items()}


def _pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of them right, hold one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def compute_pass_rate(
    flat_rewards: list[float], group_size: int, num_groups: int | None = None
) -> dict[str, float]:
    """{"pass@k": mean over groups} for k = 1, 2, 4, ... <= group_size; {} for groups of 1."""
    if group_size == 1:
        return {}
    if num_groups is None:
        num_groups = len(flat_rewards) // group_size
    if len(flat_rewards) != num_groups * group_size:
        raise ValueError(f"{len(flat_rewards)} rewards are not {num_groups} groups of {group_size}")
    correct = [
        sum(1 for r in flat_rewards[g * group_size : (g + 1) * group_size] if r == 1)
        for g in range(num_groups)
    ]
    ks = [2**i for i in range(int(math.log2(group_size)) + 1)]
    return {
        f"pass@{k}": sum(_pass_at_k(group_size, c, k) for c in correct) / num_groups for k in ks
    }


def compute_statistics(values: list[float]) -> dict[str, float]:
    if not values:
        raise ValueError("compute_statistics of no values")  # numpy's mean of [] is nan + warning
    return {
        "mean": float(statistics.fmean(values)),
        "median": float(statistics.median(values)),
        "max": float(max(values)),
        "min": float(min(values)),
    }


def compression_ratio(
    data: str | bytes, *, encoding: str = "utf-8", algorithm: str = "zlib", level: int = 9
) -> tuple[float, float]:
    """(original / compressed length, percent saved), by zlib, gzip, bz2 or lzma."""
    import bz2
    import gzip
    import lzma
    import zlib

    raw = data.encode(encoding) if isinstance(data, str) else data
    if not raw:
        return float("inf"), 0.0
    compress = {
        "zlib": lambda b: zlib.compress(b, level),
        "gzip": lambda b: gzip.compress(b, compresslevel=level),
        "bz2": lambda b: bz2.compress(b, compresslevel=level),
        "lzma": lambda b: lzma.compress(b, preset=level),
    }
    if algorithm not in compress:
        raise ValueError(f"Unsupported algorithm: {algorithm}")
    size = len(compress[algorithm](raw))
    if size == 0:
        return float("inf"), 100.0
    return len(raw) / size, 100.0 * (1.0 - size / len(raw))


def has_repetition(text: str) -> bool:
    return len(text) > 10000 and compression_ratio(text[-10000:])[0] > 10


def compute_rollout_step(args: Any, rollout_id: int) -> int:
    if getattr(args, "wandb_always_use_train_step", False):
        return (
            rollout_id
            * args.rollout_batch_size
            * args.n_samples_per_prompt
            // (args.global_batch_size)
        )
    return rollout_id
