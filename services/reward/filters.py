"""Dynamic-sampling filters (`--dynamic-sampling-filter-path`): keep a scored group or drop it.

A filter is Miles' `fn(args, samples, **kwargs) -> DynamicFilterOutput`, sync or async, called
after every sample has its reward, where `args` is Miles' read-only namespace of the run's
flags and `samples` the group's list of Miles `Sample`s with their rewards (compat/miles/).
It returns a DynamicFilterOutput (ours, Miles' or any object with `keep` and optionally
`reason`), a dict with `keep`, or a bare bool (read as `keep`, as Miles' call_dynamic_filter
does).
A dropped group is published with verdict FILTERED and the reason, so the trainer's admission
admits a replacement (docs/operations.md). Eval groups are never filtered. A filter that
raises, or returns anything else, fails the group as a plugin error (reward/scorer.py,
common/plugin_errors.py).

Built-ins (Miles' names; a bare name, our module path, or Miles'/slime's module path all
resolve to ours, so a Miles launch line works unchanged):

* `check_reward_nonzero_std`: drop a group whose rewards are all equal (population std
  <= 1e-8): it has no learning signal under group-normalised advantages.
* `check_no_aborted`: drop a group with any aborted sample (engine paused, env crash).

`--rollout-sample-filter-path` is Miles' per-sample loss filter, `fn(args, data) -> None` with
`data: list[list[Sample]]`, setting `sample.remove_sample = True` on the samples the loss must
leave out (they still count in the group's advantage normalisation). Miles calls it once per
rollout batch; here it runs per kept training group, as `fn(args, [group])`, and a removed
sample's loss mask goes to the trainer all zeros (Miles' train-data conversion does the same).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from millstream.common.types import SampleGroup
from millstream.compat.miles import (
    DynamicFilterOutput,
    check_not_old_signature,
    samples_from_pb,
)
from millstream.compat.miles.filter_hub import check_no_aborted, check_reward_nonzero_std
from millstream.compat.plugins import load_function

FilterOutput = DynamicFilterOutput  # the name this module used before Miles' own

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
    fn = load_function(path, "--dynamic-sampling-filter-path")
    check_not_old_signature(fn, "--dynamic-sampling-filter-path", path)
    return fn


def resolve_sample_filter(path: str) -> Callable[..., Any]:
    return load_function(path, "--rollout-sample-filter-path")


async def apply_sample_filter(fn: Callable[..., Any], group: SampleGroup, args: Any) -> list[int]:
    """Run Miles' per-sample loss filter on the kept `group` and zero the loss mask of every
    sample it removes; returns their indices."""
    samples = samples_from_pb(group.samples, group.prompt.prompt_text, scored=True)
    for s in samples:
        s.group_index = group.prompt.data_index
    out = fn(args, [samples])
    if inspect.isawaitable(out):
        await out
    removed = []
    for pb, sample in zip(group.samples, samples, strict=True):
        if sample.remove_sample:
            pb.loss_mask[:] = [0] * len(pb.response_token_ids)
            removed.append(pb.index)
    return removed


async def apply_filter(fn: Callable[..., Any], group: SampleGroup, args: Any) -> FilterOutput:
    """Run the filter on the scored `group` (converted to Miles' Samples here) and read its
    answer; TypeError naming the value when it is unreadable."""
    samples = samples_from_pb(group.samples, group.prompt.prompt_text, scored=True)
    for s in samples:
        s.group_index = group.prompt.data_index
    out = fn(args, samples)
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
    shown = repr(out) if len(repr(out)) <= 200 else repr(out)[:200] + "..."
    raise TypeError(
        f"the dynamic-sampling filter returned {shown} ({type(out).__name__}): expected a "
        "DynamicFilterOutput, a bool, or a dict or object with `keep`"
    )
