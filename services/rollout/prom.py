"""The rollout worker's Prometheus metrics (served with `--metrics-port`).

Per group: `millstream_rollout_group_duration_seconds` (the rollout function, router calls
included) and `millstream_rollout_queue_wait_seconds` (the trainer's admission to this
worker's start: wall clocks of two machines, so good to their skew). Groups handed on failed
(the router could not generate) are counted apart; the StreamWorker's job counts and the
depth of {run}:prompts come from common/prom.py.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Histogram

from millstream.common.prom import DURATION_BUCKETS, Readings, WorkerCounts, new_registry


class RolloutMetrics:
    def __init__(self, worker: Any):
        """`worker`: the RolloutWorker (its stream_worker and failed_groups are read)."""
        self.registry = new_registry()
        self.group_seconds = Histogram(
            "millstream_rollout_group_duration_seconds",
            "seconds in the rollout function per group (every sample generated)",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.queue_seconds = Histogram(
            "millstream_rollout_queue_wait_seconds",
            "seconds from the trainer's admission of a group to a worker starting it",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        readings = Readings()
        readings.add(
            "counter",
            "millstream_rollout_groups_failed",
            "groups handed on failed: the router could not generate their samples",
            lambda: worker.failed_groups,
        )
        self.registry.register(readings)
        self.registry.register(WorkerCounts([worker.stream_worker]))

    def observe(self, timings: Any) -> None:
        """A finished group's `timings` (SampleGroup.timings: `rollout`, `rollout_queue`)."""
        if "rollout" in timings:
            self.group_seconds.observe(timings["rollout"])
        if "rollout_queue" in timings:
            self.queue_seconds.observe(timings["rollout_queue"])
