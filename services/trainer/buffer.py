"""The trainer's buffer: `{run}:scored` and `{run}:dead`, each read in its `trainer` consumer
group into memory.

It owns the terminal accounting. Every admitted group id reaches exactly one terminal state
here (trained, filtered, failed, dropped_stale). A group is "expected" while it is admitted
and not yet terminal (`expected(gid)`, the admission's in-flight map, which is part of the
checkpoint); any other arrival (at-least-once delivery, a group re-admitted after a resume,
an id this run never admitted) is counted as a duplicate and ignored, also across a restart.
Nothing here grows with the length of the run: per-group state lives from arrival to terminal.
Both readers are StreamWorkers, so a Redis outage shorter than --redis-outage-timeout costs
only time: what arrived stays here, and the acks go out once Redis is back.

A group failed because a plugin raised (`plugin_error`) is terminal `failed` like any other;
`plugins` (observe/plugin_failures.py) prints its traceback the first time and, after
--max-consecutive-failed-groups of them in a row, makes `check` (so every wait here) raise
PluginCrashed, which ends the run.

Dead letters are terminal too: an entry any consumer dead-lettered (bad bytes, a job that
kept failing, too many deliveries) is decoded as far as it can be, and its group, when this
run expects it, ends `failed` with the dead letter's reason, which frees its admission slot.

Kept training groups wait in arrival order until `take` hands `rollout_batch_size` of them to
the train step. The buffer knows what they weigh: `held_bytes` is the wire size of the kept
groups not yet terminal (`held_groups`), and `on_size` hears the size of every kept or filtered
training group that arrives (admission's --max-buffer-bytes, admission.py `ByteBound`).
Staleness is measured at `take`, against the version being trained: a sample's lag is V minus
the version of its oldest token; with --max-weight-staleness a group beyond it
is dropped and counted. Eval groups go to whoever waits for them (`wait_eval`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext

from millstream.common import aio, streams, telemetry
from millstream.common.keys import GROUP_TRAINER, STREAM_GENERATED, STREAM_PROMPTS, RunKeys
from millstream.common.streams import Consumer, StreamEntry
from millstream.common.types import PromptGroup, SampleGroup, ScoredGroup, Verdict
from millstream.common.worker import StreamWorker

from .observe.plugin_failures import PluginFailures

log = logging.getLogger(__name__)


READ_BATCH = 256
"""Scored entries read (and held unacked) at once."""

DEAD_MAX_DELIVERIES = 1_000_000
"""The dead-letter reader never fails an entry, so nothing it reads goes back to the dead
stream; the bound only matters if the trainer dies on the same entry again and again."""


def group_lag(scored: ScoredGroup, version: int) -> int:
    """Versions between the oldest token of the group and `version` (0 for an empty group)."""
    oldest = [min(s.weight_versions) for s in scored.group.samples if s.weight_versions]
    return version - min(oldest) if oldest else 0


class Buffer:
    def __init__(
        self,
        redis: Any,
        keys: RunKeys,
        consumer_name: str,
        *,
        claim_idle_ms: int,
        max_deliveries: int,
        block_ms: int,
        on_terminal: Callable[[str, str], None],
        expected: Callable[[str], bool],
        max_consecutive_failed_groups: int = 0,
        run_instance: str = "",
        fence: int | None = None,
        on_size: Callable[[int], None] | None = None,
    ):
        # With the trainer's fencing number (lease.py) every ack and claim is fenced: once a
        # newer trainer holds the run, a read here raises FencedOut, which `check` surfaces.
        fenced = None if fence is None else (keys.fence, fence)
        self.consumer = Consumer(
            redis, keys.scored, GROUP_TRAINER, consumer_name,
            claim_idle_ms=claim_idle_ms, max_deliveries=max_deliveries, dead_stream=keys.dead, block_ms=block_ms,
            fence=fenced,
        )  # fmt: skip
        # Many entries per read (an eval round's 200 groups arrive together): the handler
        # never yields before it holds `_arrived`, whose lock is FIFO, so groups still land
        # in arrival order; the acks of one turn go out as one pipeline.
        self.worker = StreamWorker(
            self.consumer, self._handle, concurrency=READ_BATCH, name="buffer", auto_ack=True
        )
        self.dead_consumer = Consumer(
            redis, keys.dead, GROUP_TRAINER, consumer_name,
            claim_idle_ms=claim_idle_ms, max_deliveries=DEAD_MAX_DELIVERIES, dead_stream=keys.dead, block_ms=block_ms,
            fence=fenced,
        )  # fmt: skip
        self.dead_worker = StreamWorker(
            self.dead_consumer, self._handle_dead, concurrency=1, name="buffer:dead",
            auto_ack=True, check_entries=False,
        )  # fmt: skip
        self.expected = expected
        self.run_instance = run_instance
        self.earlier_run = 0  # groups of an earlier run with this run id, dropped
        self.plugins = PluginFailures(max_consecutive_failed_groups)
        self.duplicates = 0
        self.dead_letters = 0  # groups of this run that ended failed from the dead stream
        self.dead_foreign = 0  # dead entries that are no group this run waits for
        self._on_terminal = on_terminal
        self._kept: deque[ScoredGroup] = deque()
        self._waiting: set[str] = set()  # ids of the kept groups in `_kept`
        self._on_size = on_size
        self._sizes: dict[str, int] = {}  # kept group id -> its entry's bytes
        self.held_bytes = 0  # the sum of `_sizes`
        self._arrived = asyncio.Condition()
        self._eval: dict[str, ScoredGroup] = {}
        # gid -> (the trace context it arrived with, its XADD time in ns)
        self._contexts: dict[str, tuple[Context, int]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._feeders: list[asyncio.Task[Any]] = []  # tasks without which no group comes

    async def start(self) -> None:
        await self.consumer.ensure_group()
        await self.dead_consumer.ensure_group()
        self._tasks = [
            asyncio.create_task(self.worker.run(), name="buffer"),
            asyncio.create_task(self.dead_worker.run(), name="buffer:dead"),
        ]

    async def stop(self) -> None:
        self.worker.stop()
        self.dead_worker.stop()
        for task in self._tasks:
            await task

    def watch_feeder(self, task: asyncio.Task[Any]) -> None:
        """Have `check` surface `task`'s error too: the trainer's admission, without which no
        new group is published (a wait for a batch would wait forever)."""
        self._feeders.append(task)

    def check(self) -> None:
        """Surface a crashed reader or feeder instead of waiting on it forever, and a plugin
        that keeps failing groups (PluginCrashed)."""
        self.plugins.check()
        for task in self._tasks + self._feeders:
            if task.done() and not task.cancelled():
                task.result()

    async def _handle(self, entry: StreamEntry) -> None:
        scored = streams.decode(entry, ScoredGroup)
        gid = scored.group.prompt.group_id
        if self._earlier_run(scored.group.prompt):
            return
        async with self._arrived:
            if scored.group.prompt.is_eval:
                if gid in self._eval:
                    self.duplicates += 1
                else:
                    self._eval[gid] = scored
                    self.plugins.observe(scored)
            elif gid in self._waiting or not self.expected(gid):
                self.duplicates += 1
            elif scored.verdict == Verdict.VERDICT_KEPT:
                self.plugins.observe(scored)
                self._kept.append(scored)
                self._waiting.add(gid)
                size = len(entry.data or b"")
                self._sizes[gid] = size
                self.held_bytes += size
                if self._on_size is not None:
                    self._on_size(size)
                parent = telemetry.context_from_fields(entry.trace_fields)
                if trace.get_current_span(parent).get_span_context().is_valid:
                    self._contexts[gid] = (parent, telemetry.entry_time_ns(entry.id))
            else:
                state = "filtered" if scored.verdict == Verdict.VERDICT_FILTERED else "failed"
                if self._on_size is not None and state == "filtered":
                    self._on_size(len(entry.data or b""))
                self.plugins.observe(scored)
                self._terminal(gid, state)
                if state == "failed":
                    log.warning(
                        "group %s failed: %s", gid, scored.reason or scored.group.failure_reason
                    )
            self._arrived.notify_all()

    async def _handle_dead(self, entry: StreamEntry) -> None:
        """One dead letter: its group, when this run waits for it, ends failed with the reason.
        Never raises (a failure here would send the entry back to the dead stream)."""
        reason = _field(entry, b"reason") or "dead-lettered (no reason given)"
        source = _field(entry, b"source_stream")
        prompt = _dead_prompt(entry, source)
        if prompt is not None and self._earlier_run(prompt):
            return
        async with self._arrived:
            if prompt is None or not prompt.group_id:
                self.dead_foreign += 1
                log.warning("dead entry %s from %s is not a group: %s", entry.id, source, reason)
            elif prompt.is_eval:
                failed = ScoredGroup(verdict=Verdict.VERDICT_FAILED, reason=reason)
                failed.group.prompt.CopyFrom(prompt)
                self._eval.setdefault(prompt.group_id, failed)
            elif prompt.group_id in self._waiting or not self.expected(prompt.group_id):
                self.dead_foreign += 1
                log.warning(
                    "dead entry %s from %s is group %s, which this run does not wait for: %s",
                    entry.id, source, prompt.group_id, reason,
                )  # fmt: skip
            else:
                self.dead_letters += 1
                self.plugins.in_row = 0  # a failure, not a plugin's
                log.warning(
                    "group %s failed (dead letter from %s): %s", prompt.group_id, source, reason
                )
                self._terminal(prompt.group_id, "failed")
            self._arrived.notify_all()

    def _earlier_run(self, prompt: PromptGroup) -> bool:
        """A group another start of this run id admitted (`run_instance`): dropped, said once.
        Its id may be one this run admitted too (ids count from e0-i0 in every run)."""
        if not self.run_instance or prompt.run_instance == self.run_instance:
            return False
        if self.earlier_run == 0:
            log.warning(
                "group %s was admitted by an earlier run with this run id (instance %r, this "
                "run's %r): dropped, as every such group still in the streams",
                prompt.group_id, prompt.run_instance, self.run_instance,
            )  # fmt: skip
        self.earlier_run += 1
        return True

    def _terminal(self, gid: str, state: str) -> None:
        self._waiting.discard(gid)
        self.held_bytes -= self._sizes.pop(gid, 0)
        if state != "trained":
            self._contexts.pop(gid, None)
        self._on_terminal(gid, state)

    @property
    def ready(self) -> int:
        return len(self._kept)

    @property
    def held_groups(self) -> int:
        """Kept groups here, not yet terminal: those waiting and those a `take` has in hand
        (`held_bytes` is their size)."""
        return len(self._sizes)

    async def take(self, n: int, version: int, max_lag: int | None) -> list[ScoredGroup]:
        """Wait for n kept groups within the staleness bound; drop (and count) staler ones."""
        batch: list[ScoredGroup] = []
        async with self._arrived:
            while len(batch) < n:
                self.plugins.check()
                while not self._kept:
                    self.check()
                    await self._wait()
                scored = self._kept.popleft()
                gid = scored.group.prompt.group_id
                if max_lag is not None and group_lag(scored, version) > max_lag:
                    self._terminal(gid, "dropped_stale")
                    continue
                batch.append(scored)
        for scored in batch:
            self._terminal(scored.group.prompt.group_id, "trained")
        return batch

    def drop_leftovers(self) -> int:
        """At the end of a run: kept groups no batch needed become dropped_at_end."""
        n = len(self._kept)
        while self._kept:
            self._terminal(self._kept.popleft().group.prompt.group_id, "dropped_at_end")
        return n

    def trace_taken(self, groups: list[ScoredGroup]) -> list[SpanContext]:
        """End each taken group's `buffer_wait` span (from its XADD on `{run}:scored` to now)
        in its own trace; returns their contexts, for the train step's span links."""
        tr = telemetry.tracer("millstream.trainer")
        contexts = []
        for g in groups:
            gid = g.group.prompt.group_id
            found = self._contexts.pop(gid, None)
            if found is not None:
                parent, since_ns = found
                ids = {telemetry.GROUP_ID: gid}
                span = telemetry.wait_span(
                    tr, self.consumer.stream, "buffer_wait", since_ns, parent, ids
                )
                contexts.append(span.get_span_context())
        return contexts

    async def _wait(self) -> None:
        """Wait for an arrival, waking every second to notice a crashed reader."""
        with contextlib.suppress(TimeoutError):
            await aio.wait_for(self._arrived.wait(), timeout=1.0)

    async def wait_eval(self, group_ids: list[str]) -> list[ScoredGroup]:
        """Wait until every eval group arrived; returns them in the given order."""
        async with self._arrived:
            while any(gid not in self._eval for gid in group_ids):
                self.check()
                await self._wait()
            return [self._eval.pop(gid) for gid in group_ids]


def _field(entry: StreamEntry, name: bytes) -> str:
    value = entry.fields.get(name, b"")
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _dead_prompt(entry: StreamEntry, source: str) -> PromptGroup | None:
    """The PromptGroup inside a dead entry's data, by the stream it came from; None when the
    bytes are no message of that stream (bad bytes, no data)."""
    if not entry.data:
        return None
    kind = source.rsplit(":", 1)[-1]
    try:
        if kind == STREAM_PROMPTS:
            return PromptGroup.FromString(entry.data)
        if kind == STREAM_GENERATED:
            return SampleGroup.FromString(entry.data).prompt
        return ScoredGroup.FromString(entry.data).group.prompt
    except DecodeError:
        return None
