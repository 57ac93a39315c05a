"""The trainer's Prometheus metrics on rank 0 (served with `--metrics-port`; metrics.py is the
metrics.jsonl logger, not this).

Read from the Trainer at scrape time: the policy version and iteration, the admission's
groups in flight (admitted, not yet terminal: what --max-staleness bounds), kept groups
waiting for a batch, admitted and terminal counts (they continue from a resumed checkpoint's),
samples trained, duplicates ignored. Observed as it happens: the seconds of each weight sync
(`TimedSync`, pause to serve, the resume sync included). The buffer's two StreamWorkers
(`buffer` on {run}:scored, `buffer:dead` on {run}:dead) and the depths of the run's four
streams come from common/prom.py.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Histogram

from millstream.common.prom import DURATION_BUCKETS, Readings, WorkerCounts, new_registry

TERMINAL_STATES = ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end")


class TimedSync:
    """A WeightSync whose `sync()` calls that succeed are timed into `histogram`; every other
    attribute is the wrapped object's."""

    def __init__(self, sync: Any, histogram: Histogram):
        self._sync = sync
        self._histogram = histogram

    async def sync(self, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        report = await self._sync.sync(*args, **kwargs)
        self._histogram.observe(time.monotonic() - start)
        return report

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sync, name)


class TrainerMetrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        self.sync_seconds = Histogram(
            "millstream_trainer_weight_sync_duration_seconds",
            "seconds of one weight sync: pause, push every bucket, serve the new version",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )

    def timed(self, sync: Any) -> TimedSync:
        return TimedSync(sync, self.sync_seconds)

    def watch(self, trainer: Any) -> None:
        """Export `trainer`'s state (its `p.admission`, `p.buffer`, version, iteration)."""
        p = trainer.p
        r = Readings()
        r.add(
            "gauge",
            "millstream_trainer_weight_version",
            "policy version: weight syncs done",
            lambda: trainer.version,
        )
        r.add(
            "gauge", "millstream_trainer_iteration", "rollout steps done", lambda: trainer.iteration
        )
        r.add(
            "gauge",
            "millstream_trainer_groups_in_flight",
            "groups admitted and not yet terminal (bounded by the staleness budget)",
            lambda: len(p.admission.in_flight),
        )
        r.add(
            "gauge",
            "millstream_trainer_groups_ready",
            "kept groups in the buffer waiting for a batch",
            lambda: p.buffer.ready,
        )
        r.add(
            "counter",
            "millstream_trainer_groups_admitted",
            "groups published to the prompts stream",
            lambda: p.admission.counts.admitted,
        )
        r.add(
            "counter",
            "millstream_trainer_groups_terminal",
            "groups that reached their one terminal state, by state",
            lambda: {(s,): getattr(p.admission.counts, s) for s in TERMINAL_STATES},
            labels=("state",),
        )
        r.add(
            "counter",
            "millstream_trainer_samples_trained",
            "samples trained on (completions)",
            lambda: trainer.completions,
        )
        r.add(
            "counter",
            "millstream_trainer_duplicate_groups",
            "scored groups ignored as duplicates (at-least-once delivery, re-admissions)",
            lambda: p.buffer.duplicates,
        )
        self.registry.register(r)
        self.registry.register(WorkerCounts([p.buffer.worker, p.buffer.dead_worker]))
