"""The reward worker's Prometheus metrics (served with `--metrics-port`).

Per group taken from {run}:generated: `millstream_reward_group_duration_seconds` (the
scorer's `timings["reward"]`: every sample's reward, retries and the filter) and
`millstream_reward_groups_total` by verdict (kept, filtered, failed). Reward attempts that
failed or timed out and the retries they caused are the scorer's counts (gRPC Score calls
included). The StreamWorker's job counts and the depth of {run}:generated come from
common/prom.py.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Histogram

from millstream.common.prom import DURATION_BUCKETS, Readings, WorkerCounts, new_registry
from millstream.common.types import ScoredGroup, Verdict

VERDICTS = {
    Verdict.VERDICT_KEPT: "kept",
    Verdict.VERDICT_FILTERED: "filtered",
    Verdict.VERDICT_FAILED: "failed",
}


class RewardMetrics:
    def __init__(self, worker: Any):
        """`worker`: the RewardWorker (its stream_worker and scorer.stats are read)."""
        self.registry = new_registry()
        self.group_seconds = Histogram(
            "millstream_reward_group_duration_seconds",
            "seconds to score one group (all its samples, retries and the filter)",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.groups = Counter(
            "millstream_reward_groups",
            "groups scored from the generated stream, by verdict",
            ["verdict"],
            registry=self.registry,
        )
        for name in VERDICTS.values():
            self.groups.labels(name)  # every verdict reads 0 before its first group
        stats = worker.scorer.stats
        readings = Readings()
        readings.add(
            "counter",
            "millstream_reward_attempts_failed",
            "reward attempts that failed, by reason (timeout: --reward-timeout; error: raised, "
            "retried; plugin: the --custom-rm-path function's bug, not retried)",
            lambda: {
                ("timeout",): stats["reward_timeouts"],
                ("error",): stats["reward_errors"],
                ("plugin",): stats["reward_plugin_errors"],
            },
            labels=("reason",),
        )
        readings.add(
            "counter",
            "millstream_reward_retries",
            "reward attempts retried (--reward-retries)",
            lambda: stats["reward_retries"],
        )
        self.registry.register(readings)
        self.registry.register(WorkerCounts([worker.stream_worker]))

    def observe(self, scored: ScoredGroup) -> None:
        self.groups.labels(VERDICTS.get(scored.verdict, "unknown")).inc()
        if "reward" in scored.group.timings:
            self.group_seconds.observe(scored.group.timings["reward"])
