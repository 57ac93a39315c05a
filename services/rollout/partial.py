"""The partial buffer: groups whose samples were aborted by a weight sync wait here, then
resume in the order `--buffer-filter-path` picks (docs/operations.md).

When engines pause with mode abort, in-flight generations come back with finish_reason
abort. The group's job parks itself here (its stream entry stays pending, and the worker keeps
renewing it because the job is still running) until the sync looks over:

  * the router serves a different weight version than when the group parked
    (`GET /get_weight_version`, polled every `poll_s` while anything is parked), or
  * a generation finished without abort after the group parked (the engines answer again), or
  * `max_wait_s` passed. Resuming early is safe: an engine paused for a sync holds new
    requests until `/continue_generation` (SGLang and the built-in engine alike), so the
    resumed request runs under the new weights; at worst it is aborted again, which the
    caller bounds.

Groups released together are ordered by the buffer filter, Miles' `fn(args, rollout_id,
buffer, num_samples) -> list[list[Sample]]` (compat/miles/), called with `rollout_id=None`
(as Miles calls it) and `num_samples=len(buffer)`, where `buffer` holds one list of Miles
Samples per group: its `partial_samples`, where its samples stand (default: Miles'
`pop_first`, first in, first out). The lists it returns (the buffer's own, or any whose
samples carry the group's `group_id`) give the order. The position becomes the resumed requests' priority for a
generation slot, ahead of every fresh request. A filter that leaves a group out does not drop
it: every admitted group ends in one terminal state, so the left-out ones resume last, FIFO.
A filter that raises fails the groups it was to order (`wait` raises its error: the worker
fails them, common/plugin_errors.py) rather than leaving them parked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from millstream.common.types import PromptGroup
from millstream.compat.miles import Sample, groups_from_pb

from .client import RouterClient

log = logging.getLogger("millstream.rollout")

BufferFilter = Callable[[Any, int | None, list[list[Sample]], int], list[list[Sample]]]


def pop_first(
    args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int
) -> list[list[Sample]]:
    """Miles' default buffer filter: the first `num_samples` groups, in the order they parked."""
    num_to_pop = min(len(buffer), num_samples)
    samples = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    return samples


fifo = pop_first  # the name this module used before Miles' own


def resume_order(
    groups: list[PromptGroup], buffer_filter: BufferFilter, args: Any = None
) -> list[str]:
    """Group ids in resume order: the filter's choice, then any it left out (FIFO)."""
    buffer = groups_from_pb(groups)
    by_list = {id(samples): g.group_id for samples, g in zip(buffer, groups, strict=True)}
    chosen_lists = buffer_filter(args, None, list(buffer), len(buffer))
    chosen = []
    for samples in chosen_lists or []:
        gid = by_list.get(id(samples))
        if gid is None:
            gid = samples[0].group_id if samples else "<an empty list not from the buffer>"
        chosen.append(gid)
    known = {g.group_id for g in groups}
    unknown = [gid for gid in chosen if gid not in known]
    if unknown:
        raise ValueError(f"buffer filter returned groups that were not in the buffer: {unknown}")
    ordered = list(dict.fromkeys(chosen))
    return ordered + [g.group_id for g in groups if g.group_id not in set(ordered)]


@dataclass(eq=False)
class _Parked:
    snapshot: Callable[[], PromptGroup]
    since: float
    version: str | None
    waiters: int = 0
    released: asyncio.Event = field(default_factory=asyncio.Event)
    priority: int = 0
    error: Exception | None = None  # the buffer filter's: the group fails with it


class PartialBuffer:
    """See the module docstring. `run()` is the release loop; `wait()` parks a group."""

    def __init__(
        self,
        client: RouterClient,
        buffer_filter: BufferFilter = pop_first,
        *,
        args: Any = None,
        poll_s: float = 0.5,
        max_wait_s: float = 5.0,
    ):
        self.client = client
        self.buffer_filter = buffer_filter
        self.args = args  # Miles' args, handed to the buffer filter
        self.poll_s = poll_s
        self.max_wait_s = max_wait_s
        self.resumed = 0
        self._parked: dict[str, _Parked] = {}
        self._answered_at = float("-inf")
        self._something_parked = asyncio.Event()

    def __len__(self) -> int:
        return len(self._parked)

    def engines_answered(self) -> None:
        """A generation finished without abort: the engines serve again."""
        self._answered_at = time.monotonic()

    async def wait(self, group_id: str, snapshot: Callable[[], PromptGroup]) -> int:
        """Park the group until it may resume; returns its priority for a generation slot.
        Samples of one group parked around the same time share one place in the buffer."""
        parked = self._parked.get(group_id)
        if parked is None:
            since = time.monotonic()
            version = await self.client.get_weight_version()
            # Another sample of the group may have parked while we asked the router.
            parked = self._parked.setdefault(group_id, _Parked(snapshot, since, version))
            self._something_parked.set()
        parked.waiters += 1
        try:
            await parked.released.wait()
        finally:
            parked.waiters -= 1
            if parked.waiters == 0 and self._parked.get(group_id) is parked:
                del self._parked[group_id]  # cancelled before release: nothing to resume
        if parked.error is not None:
            raise parked.error
        return parked.priority

    async def run(self) -> None:
        """Release parked groups as their sync ends; runs until cancelled."""
        while True:
            await self._something_parked.wait()
            await asyncio.sleep(self.poll_s)
            if not self._parked:
                self._something_parked.clear()
                continue
            version = await self.client.get_weight_version()
            self.release_ready(version, time.monotonic())

    def release_ready(self, version: str | None, now: float) -> list[str]:
        """Release the groups whose sync looks over (module docstring), in filter order;
        returns their ids."""
        ready = {
            gid: p
            for gid, p in self._parked.items()
            if (version is not None and version != p.version)
            or self._answered_at > p.since
            or now - p.since >= self.max_wait_s
        }
        if not ready:
            return []
        try:
            order = resume_order(
                [p.snapshot() for p in ready.values()], self.buffer_filter, self.args
            )
        except Exception as err:  # a buffer filter's bug fails its groups, none waits forever
            for gid, parked in ready.items():
                del self._parked[gid]
                parked.error = err
                parked.released.set()
            return []
        for gid in order:
            parked = self._parked.pop(gid)
            parked.priority = self.resumed
            self.resumed += 1
            parked.released.set()
        log.info("resuming %d partial group(s) (version %s)", len(order), version)
        return order
