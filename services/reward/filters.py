"""Dynamic-sampling filters (`--dynamic-sampling-filter-path`): keep a scored group or drop it.

A filter is `fn(samples, cfg) -> keep`, sync or async, called after every sample has its
reward, where `samples` is the group's list of Samples and `cfg` the RunConfig. It returns a
bool, or an object (or dict) with `keep` and optionally `reason`, like Miles' FilterOutput.
A dropped group is published with verdict FILTERED and the reason, so the trainer's admission
admits a replacement (DESIGN.md section 4). Eval groups are never filtered.

Built-ins (Miles' names; a bare name, our module path, or Miles'/slime's module path all
resolve to ours, so a Miles launch line works unchanged):

* `check_reward_nonzero_std`: drop a group whose rewards are all equal (population std
  <= 1e-8): it has no learning signal under group-normalised advantages.
* `check_no_aborted`: drop a group with any aborted sample (engine paused, env crash).
"""

from __future__ import annotations

import inspect
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from millstream.common.plugins import load_function
from millstream.common.types import Sample, SampleStatus

_STD_EPS = 1e-8


@dataclass(frozen=True)
class FilterOutput:
    keep: bool
    reason: str | None = None


def check_reward_nonzero_std(samples: Sequence[Sample], cfg: Any = None) -> FilterOutput:
    rewards = [s.reward for s in samples]
    if rewards and statistics.pstdev(rewards) > _STD_EPS:
        return FilterOutput(keep=True)
    first = rewards[0] if rewards else 0.0
    return FilterOutput(
        keep=False,
        reason=f"zero_std_{round(first, 1)}: all {len(rewards)} rewards equal {first:g}",
    )


def check_no_aborted(samples: Sequence[Sample], cfg: Any = None) -> FilterOutput:
    aborted = [s.index for s in samples if s.status == SampleStatus.SAMPLE_STATUS_ABORTED]
    if aborted:
        return FilterOutput(keep=False, reason=f"group_has_aborted: samples {aborted} aborted")
    return FilterOutput(keep=True)


BUILTINS: dict[str, Callable[..., FilterOutput]] = {
    "check_reward_nonzero_std": check_reward_nonzero_std,
    "check_no_aborted": check_no_aborted,
}
_ALIAS_PREFIXES = (
    "millstream.reward.filters.",
    "miles.rollout.filter_hub.",
    "slime.rollout.filter_hub.",
)


def resolve_filter(path: str) -> Callable[..., Any]:
    """The filter named by `path`: a built-in's bare name or known alias, else a user function."""
    name = path.rsplit(".", 1)[-1]
    if name in BUILTINS and (path == name or path.startswith(_ALIAS_PREFIXES)):
        return BUILTINS[name]
    return load_function(path, "--dynamic-sampling-filter-path")


async def apply_filter(fn: Callable[..., Any], samples: Sequence[Sample], cfg: Any) -> FilterOutput:
    """Run the filter and read its answer; TypeError naming the value when it is unreadable."""
    out = fn(list(samples), cfg)
    if inspect.isawaitable(out):
        out = await out
    if isinstance(out, FilterOutput):
        return out
    if isinstance(out, bool):
        return FilterOutput(keep=out)
    if isinstance(out, dict) and "keep" in out:
        return FilterOutput(keep=bool(out["keep"]), reason=out.get("reason"))
    if hasattr(out, "keep"):
        return FilterOutput(keep=bool(out.keep), reason=getattr(out, "reason", None))
    raise TypeError(
        f"dynamic-sampling filter returned {out!r}: expected a bool or an object with .keep"
    )
