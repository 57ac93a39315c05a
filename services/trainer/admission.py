"""Admission: the trainer publishes prompt groups, never more than the staleness budget allows.

Let V be the policy version (weight syncs done) and s = --max-staleness (0 in sync mode).
Groups that can still be trained are `live = admitted - filtered - failed - dropped`. The
invariant kept here (docs/operations.md):

    live <= (V + s + 1) * rollout_batch_size + slack,   slack = over_sampling - rollout_batch_size

Filtered and failed groups are terminal, so they free room and admission replaces them: the
self-healing oversampling of dynamic sampling. Sync mode is this same code with s = 0.

Every admitted group is tracked until it reaches its one terminal state; the groups still in
flight are part of the checkpoint and re-admitted on resume (the buffer's dedup by group id
makes a re-admitted group count once).

Bytes (`--max-buffer-bytes`, `ByteBound`): the count bounds groups, not what they weigh, and a
group of 16 samples of 32k tokens is ~7 MB on the wire, held in Redis (twice: `generated` and
`scored` until trimmed) and in the buffer. With a bound, admission also keeps

    held bytes (the kept groups in the buffer, by their size on the wire)
      + groups still out x the largest group of the last 64 back (before any: `prior`)
    <= max_buffer_bytes

except that it never holds fewer than one batch in flight (the trainer would wait for a batch
that nothing admits). It says so when it starts holding back for bytes, once per episode.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind

from millstream.common import streams, telemetry
from millstream.common.types import PromptGroup

from .data import PluginDataSource, PromptDataSource, PromptRow

BYTES_PER_TOKEN_PRIOR = 14
"""Wire bytes of one response token in a ScoredGroup, before any group came back: its id (a
varint, 3 bytes for a large vocabulary), logprob (4), loss mask (1), weight version (1-2) and
its text (~4). bench/bench_long_rollouts.py measures 12.6-13.6."""
RECENT_GROUPS = 64


def group_id(epoch: int, data_index: int) -> str:
    return f"e{epoch}-i{data_index}"


@dataclass
class TerminalCounts:
    """How every admitted group ended; admitted == sum(terminal) + in flight, always."""

    admitted: int = 0
    trained: int = 0
    filtered: int = 0
    failed: int = 0
    dropped_stale: int = 0  # beyond --max-weight-staleness
    dropped_at_end: int = 0  # kept, but the run ended before a batch needed it (async mode)

    @property
    def dropped(self) -> int:
        return self.dropped_stale + self.dropped_at_end

    @property
    def live(self) -> int:
        return self.admitted - self.filtered - self.failed - self.dropped

    @property
    def terminal(self) -> int:
        return self.trained + self.filtered + self.failed + self.dropped


@dataclass
class ByteBound:
    """--max-buffer-bytes (module docstring). `held` answers (bytes, groups) of the kept
    groups the buffer holds (buffer.py `held_bytes`, `held_groups`); `observe` is told the
    wire size of every group that comes back. `peak`: the most counted after an admission."""

    limit: int
    prior: int
    held: Callable[[], tuple[int, int]]
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT_GROUPS))
    holding: bool = False  # held back at the last fill (said once per episode)
    holds: int = 0  # episodes so far
    peak: int = 0

    def observe(self, nbytes: int) -> None:
        self.recent.append(nbytes)

    @property
    def per_group(self) -> int:
        return max(1, max(self.recent) if self.recent else self.prior)

    def counted(self, out: int) -> int:
        """Bytes held plus `out` groups not back yet at `per_group` each."""
        return self.held()[0] + out * self.per_group

    def room(self, out: int) -> int:
        """Groups that fit besides `out` still out."""
        return max(0, (self.limit - self.counted(out)) // self.per_group)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n:.0f} B"


def prior_group_bytes(n_samples: int, max_response_len: int, prompt_len: int = 0) -> int:
    """A group's wire size before any came back: every sample's prompt (`prompt_len`: the
    longest the run knows of) and its response at their longest."""
    return n_samples * ((max_response_len + prompt_len) * BYTES_PER_TOKEN_PRIOR + 256)


@dataclass
class Admission:
    redis: Any
    stream: str
    source: PromptDataSource | PluginDataSource
    rollout_batch_size: int
    n_samples: int
    max_staleness: int
    slack: int = 0
    counts: TerminalCounts = field(default_factory=TerminalCounts)
    in_flight: dict[str, tuple[int, int]] = field(
        default_factory=dict
    )  # group id -> (epoch, index)
    run_instance: str = ""  # stamped on every group (PromptGroup.run_instance, build.py)
    bytes: ByteBound | None = None  # --max-buffer-bytes

    def room(self, version: int) -> int:
        budget = (version + self.max_staleness + 1) * self.rollout_batch_size + self.slack
        return max(0, budget - self.counts.live)

    def byte_room(self, by_count: int) -> int:
        """`by_count` (the staleness budget's room) less what --max-buffer-bytes holds back,
        never below what brings one batch in flight."""
        bound = self.bytes
        if bound is None or by_count == 0:
            return by_count
        out = len(self.in_flight) - bound.held()[1]  # admitted, neither terminal nor back
        floor = max(0, self.rollout_batch_size - len(self.in_flight))
        k = max(min(by_count, bound.room(out)), min(by_count, floor))
        if k:
            bound.peak = max(bound.peak, bound.counted(out + k))
        if k < by_count and not bound.holding:
            bound.holding, bound.holds = True, bound.holds + 1
            self._say_holding(out, by_count - k)
        elif k == by_count:
            bound.holding = False
        return k

    def _say_holding(self, out: int, held_back: int) -> None:
        bound = self.bytes
        assert bound is not None
        basis = (
            f"the largest of the last {len(bound.recent)} back" if bound.recent else "none back yet"
        )
        print(
            f"[trainer] admission holds back for --max-buffer-bytes {_size(bound.limit)}: "
            f"{out} groups out and {bound.held()[1]} back count {_size(bound.counted(out))} "
            f"(~{_size(bound.per_group)} a group, {basis}); {held_back} more would fit the "
            "staleness budget. It admits again as the trainer takes groups",
            flush=True,
        )

    async def fill(self, version: int) -> int:
        """Publish as many new groups as the budget allows at `version`; returns how many."""
        k = self.byte_room(self.room(version))
        if k == 0:
            return 0
        rows = self.source.take(k)
        # Counted before the publish, which is shielded: when the run ends and the pump that
        # calls this is cancelled mid-XADD, the groups are still published and counted, and
        # the trainer's drain sees them come back (admitted == terminal states, always). The
        # publish rides out a Redis outage of up to --redis-outage-timeout (`publish_many`):
        # the groups are counted and in flight already, so giving up on them sooner would
        # lose them (a repeat that lands twice is one group downstream: the ids dedupe).
        self.counts.admitted += len(rows)
        await asyncio.shield(self._publish([(row, epoch) for row, epoch in rows], version))
        return len(rows)

    async def readmit(self, version: int) -> int:
        """Publish again the groups in flight at the checkpoint (they count once: dedup by id)."""
        rows = [(self.source.row(i), e) for e, i in self.in_flight.values()]
        await self._publish(rows, version)
        return len(rows)

    async def _publish(self, rows: list[tuple[PromptRow, int]], version: int) -> None:
        """One root span per group: each group's trace starts here (docs/observability.md)."""
        tracer = telemetry.tracer("millstream.trainer")
        messages, contexts = [], []
        for row, epoch in rows:
            gid = group_id(epoch, row.data_index)
            self.in_flight[gid] = (epoch, row.data_index)
            messages.append(self._message(gid, row, epoch, version))
            with tracer.start_as_current_span(
                f"send {self.stream}",
                context=otel_context.Context(),
                kind=SpanKind.PRODUCER,
                attributes={
                    telemetry.STAGE: "admit",
                    telemetry.GROUP_ID: gid,
                    "millstream.version": version,
                    **telemetry.messaging_attributes(self.stream, "send"),
                },
            ):
                contexts.append(telemetry.inject_fields())
        await streams.publish_many(self.redis, self.stream, messages, contexts)

    def _message(self, gid: str, row: PromptRow, epoch: int, version: int) -> PromptGroup:
        return PromptGroup(
            group_id=gid,
            data_index=row.data_index,
            epoch=epoch,
            prompt_token_ids=row.prompt_token_ids,
            prompt_text=row.prompt_text,
            label=row.label,
            label_json=row.label_json,
            metadata_json=json.dumps(row.metadata),
            n_samples=self.n_samples,
            admitted_version=version,
            run_instance=self.run_instance,
            admitted_unix=time.time(),
        )

    def terminal(self, gid: str, state: str) -> None:
        """Record a group's one terminal state: trained, filtered, failed, dropped_stale or dropped_at_end."""
        position = self.in_flight.pop(gid, None)
        if position is not None:
            self.source.release(position[1])
        setattr(self.counts, state, getattr(self.counts, state) + 1)
