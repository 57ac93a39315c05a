"""The trainer's buffer: `{run}:scored`, read in the `trainer` consumer group into memory.

It owns the terminal accounting. Every group id reaches exactly one terminal state here
(trained, filtered, failed, dropped_stale) and a second delivery of the same id (at-least-once
delivery, or a group re-admitted after a resume) is counted as a duplicate and ignored, also
across a restart, because the consumed ids are part of the checkpoint.

Kept training groups wait in arrival order until `take` hands `rollout_batch_size` of them to
the train step. Staleness is measured there, against the version being trained: a sample's
lag is V minus the version of its oldest token; with --max-weight-staleness a group beyond it
is dropped and counted. Eval groups go to whoever waits for them (`wait_eval`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanContext

from millstream.common import streams, telemetry
from millstream.common.keys import GROUP_TRAINER, RunKeys
from millstream.common.streams import Consumer, StreamEntry
from millstream.common.types import ScoredGroup, Verdict
from millstream.common.worker import StreamWorker

log = logging.getLogger(__name__)


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
        consumed: set[str] | None = None,
    ):
        self.consumer = Consumer(
            redis, keys.scored, GROUP_TRAINER, consumer_name,
            claim_idle_ms=claim_idle_ms, max_deliveries=max_deliveries, dead_stream=keys.dead, block_ms=block_ms,
        )  # fmt: skip
        self.worker = StreamWorker(
            self.consumer, self._handle, concurrency=1, name="buffer", auto_ack=True
        )
        self.consumed: set[str] = consumed if consumed is not None else set()
        self.duplicates = 0
        self._on_terminal = on_terminal
        self._kept: deque[ScoredGroup] = deque()
        self._waiting: set[str] = set()  # ids of the kept groups in `_kept`
        self._arrived = asyncio.Condition()
        self._eval: dict[str, ScoredGroup] = {}
        self._contexts: dict[str, SpanContext] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.consumer.ensure_group()
        self._task = asyncio.create_task(self.worker.run(), name="buffer")

    async def stop(self) -> None:
        self.worker.stop()
        if self._task is not None:
            await self._task

    def check(self) -> None:
        """Surface a crashed reader instead of waiting on it forever."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            self._task.result()

    async def _handle(self, entry: StreamEntry) -> None:
        scored = streams.decode(entry, ScoredGroup)
        gid = scored.group.prompt.group_id
        async with self._arrived:
            if gid in self.consumed or gid in self._waiting or gid in self._eval:
                self.duplicates += 1
                return
            if scored.group.prompt.is_eval:
                self._eval[gid] = scored
            elif scored.verdict == Verdict.VERDICT_KEPT:
                self._kept.append(scored)
                self._waiting.add(gid)
                span = trace.get_current_span(telemetry.context_from_fields(entry.trace_fields))
                if span.get_span_context().is_valid:
                    self._contexts[gid] = span.get_span_context()
            else:
                state = "filtered" if scored.verdict == Verdict.VERDICT_FILTERED else "failed"
                self._terminal(gid, state)
                if state == "failed":
                    log.warning(
                        "group %s failed: %s", gid, scored.reason or scored.group.failure_reason
                    )
            self._arrived.notify_all()

    def _terminal(self, gid: str, state: str) -> None:
        self._waiting.discard(gid)
        self.consumed.add(gid)
        self._on_terminal(gid, state)

    @property
    def ready(self) -> int:
        return len(self._kept)

    async def take(self, n: int, version: int, max_lag: int | None) -> list[ScoredGroup]:
        """Wait for n kept groups within the staleness bound; drop (and count) staler ones."""
        batch: list[ScoredGroup] = []
        async with self._arrived:
            while len(batch) < n:
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

    def pop_span_contexts(self, groups: list[ScoredGroup]) -> list[SpanContext]:
        """The trace contexts the groups arrived with, for the train step's span links."""
        found = (self._contexts.pop(g.group.prompt.group_id, None) for g in groups)
        return [c for c in found if c is not None]

    async def _wait(self) -> None:
        """Wait for an arrival, waking every second to notice a crashed reader."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), timeout=1.0)

    async def wait_eval(self, group_ids: list[str]) -> list[ScoredGroup]:
        """Wait until every eval group arrived; returns them in the given order."""
        async with self._arrived:
            while any(gid not in self._eval for gid in group_ids):
                self.check()
                await self._wait()
            return [self._eval.pop(gid) for gid in group_ids]
