"""Miles' `miles.rollout.filter_hub`: `base_types` and `dynamic_sampling_filters`, in one module.

A dynamic-sampling filter is `fn(args, samples, **kwargs) -> DynamicFilterOutput` (or a bare
bool, read as `keep`); `call_dynamic_filter(fn, ...)` calls one that way (None keeps every
group) and `MetricGatherer` counts drops by reason as Miles' rollout logs them
(`rollout/dynamic_filter/drop_<reason>`). The reward worker runs the filters here
(reward/filters.py, which says how).

The built-in filters, Miles' names: `check_reward_nonzero_std` drops a group whose rewards
are all equal (population std <= 1e-8: no learning signal under group-normalised advantages);
`check_no_aborted` drops a group with an aborted sample. A group's items may be Samples or
lists of Samples (a generate function that returns several); both read every Sample.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .types import Sample

__all__ = [
    "DynamicFilterOutput",
    "MetricGatherer",
    "call_dynamic_filter",
    "check_no_aborted",
    "check_reward_nonzero_std",
]

_STD_EPS = 1e-8


@dataclass
class DynamicFilterOutput:
    """What a dynamic-sampling filter returns."""

    keep: bool
    reason: str | None = None


def call_dynamic_filter(fn: Callable[..., Any] | None, *args: Any, **kwargs: Any) -> Any:
    """fn's answer as a DynamicFilterOutput (keep, for no filter)."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=output)


class MetricGatherer:
    """Dropped groups by reason, as `rollout/dynamic_filter/drop_<reason>` counts."""

    def __init__(self) -> None:
        self._drops: defaultdict[str, int] = defaultdict(int)

    def on_dynamic_filter_drop(self, reason: str | None) -> None:
        if reason:
            self._drops[reason] += 1

    def collect(self) -> dict[str, int]:
        return {f"rollout/dynamic_filter/drop_{r}": n for r, n in self._drops.items()}


def _flat(samples: Sequence[Sample | list[Sample]]) -> Iterator[Sample]:
    for item in samples:
        if isinstance(item, list):
            yield from item
        else:
            yield item


def check_reward_nonzero_std(
    args: Any, samples: Sequence[Sample | list[Sample]], **kwargs: Any
) -> DynamicFilterOutput:
    rewards = [s.get_reward_value(args) for s in _flat(samples)]
    if rewards and statistics.pstdev(rewards) > _STD_EPS:
        return DynamicFilterOutput(keep=True)
    first = rewards[0] if rewards else 0.0
    return DynamicFilterOutput(
        keep=False,
        reason=f"zero_std_{round(first, 1)}: all {len(rewards)} rewards equal {first:g}",
    )


def check_no_aborted(
    args: Any, samples: Sequence[Sample | list[Sample]], **kwargs: Any
) -> DynamicFilterOutput:
    aborted = [s.index for s in _flat(samples) if s.status == Sample.Status.ABORTED]
    if aborted:
        return DynamicFilterOutput(
            keep=False, reason=f"group_has_aborted: samples {aborted} aborted"
        )
    return DynamicFilterOutput(keep=True)
