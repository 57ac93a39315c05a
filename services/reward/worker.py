"""The reward worker: `{run}:generated` -> score -> `{run}:scored`, one ScoredGroup per group.

Owns nothing but the hand-off; the consume loop is the shared StreamWorker (group `reward`,
takeover after `--claim-idle-ms`, dead letters after `--max-deliveries`, SIGTERM drains,
Redis outages ridden out for `--redis-outage-timeout`).
Each job: decode the SampleGroup (undecodable bytes are dead-lettered, never scored), score
it (`GroupScorer`: kept / filtered / failed), and `publish_and_ack` the ScoredGroup, so the
output appears exactly once per input entry even when a slow worker's entry was taken over.

Tracing: the `reward.score` span is a child of the context the entry carries, and the output
entry carries the span's context onward to the trainer.
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.trace import SpanKind

from millstream.common import telemetry
from millstream.common.config import RunConfig
from millstream.common.keys import GROUP_REWARD, RunKeys
from millstream.common.streams import Consumer, StreamEntry, decode
from millstream.common.types import SampleGroup, ScoredGroup, Verdict
from millstream.common.worker import StreamWorker

from .celery_app import CeleryExecutor, make_celery_app
from .prom import RewardMetrics
from .rewarder import Rewarder, check_reward_config
from .scorer import Executor, GroupScorer

log = logging.getLogger("millstream.reward")

HEARTBEAT_TTL_S = 15


def build_executor(cfg: RunConfig, redis_url: str, password: str | None) -> Executor:
    """Inline (this process) or Celery, as the run config says. Either way the reward config
    is checked before any work is taken; only inline scoring imports the user's reward code."""
    check_reward_config(cfg)
    if not (cfg.reward.rm_type or cfg.reward.custom_rm_path):
        log.warning(
            "no --rm-type or --custom-rm-path in the run config: only samples whose metadata "
            "names an rm_type can be scored; every other group will fail"
        )
    if cfg.reward.reward_executor == "celery":
        app = make_celery_app(redis_url, cfg.run_id, password)
        return CeleryExecutor(
            app, cfg.run_id, cfg.reward.reward_timeout, outage_s=cfg.service.redis_outage_timeout
        )
    return Rewarder(cfg)


async def score_traced(
    scorer: GroupScorer,
    group: SampleGroup,
    parent: Any,
    kind: SpanKind = SpanKind.CONSUMER,
    name: str = "reward.score",
    attributes: dict[str, Any] | None = None,
) -> tuple[ScoredGroup, dict[str, Any]]:
    """Score under a span (stage `reward`), child of `parent` (a trace context); returns the
    ScoredGroup and the span's trace fields for whatever carries the result onward."""
    span_attrs = {
        telemetry.STAGE: "reward",
        telemetry.GROUP_ID: group.prompt.group_id,
        "millstream.samples": len(group.samples),
        **(attributes or {}),
    }
    with telemetry.tracer("millstream.reward").start_as_current_span(
        name, context=parent, kind=kind, attributes=span_attrs
    ) as span:
        scored = await scorer.score(group)
        span.set_attribute("millstream.verdict", Verdict.Name(scored.verdict))
        if scored.reason:
            span.set_attribute("millstream.reason", scored.reason)
        return scored, telemetry.inject_fields({})


class RewardWorker:
    """The job handler plus the StreamWorker that feeds it."""

    def __init__(self, redis: Any, cfg: RunConfig, scorer: GroupScorer, consumer_name: str):
        self.keys = RunKeys(cfg.run_id)
        self.scorer = scorer
        self.consumer = Consumer.for_run(
            redis, cfg, self.keys.generated, GROUP_REWARD, consumer_name
        )
        self.consumer.outages.configure(  # this process's Redis outages, as in rollout's
            who=consumer_name, timeout_s=cfg.service.redis_outage_timeout
        )
        self.stream_worker = StreamWorker(
            self.consumer,
            self.handle,
            concurrency=cfg.reward.reward_max_concurrency,
            name=consumer_name,
            heartbeat=(redis, self.keys.heartbeat("reward", consumer_name), HEARTBEAT_TTL_S),
        )
        self.metrics = RewardMetrics(self)  # served by main.py with --metrics-port

    async def handle(self, entry: StreamEntry) -> None:
        group = decode(entry, SampleGroup)
        parent = telemetry.context_from_fields(entry.trace_fields)
        ids = {telemetry.GROUP_ID: group.prompt.group_id}
        queued_ns = telemetry.entry_time_ns(entry.id)
        tr = telemetry.tracer("millstream.reward")
        telemetry.wait_span(tr, entry.stream, "generated_wait", queued_ns, parent, ids)
        attributes = telemetry.process_attributes(entry.stream, entry.id, GROUP_REWARD)
        scored, fields = await score_traced(
            self.scorer, group, parent, name=f"process {entry.stream}", attributes=attributes
        )
        # With the process span's context, as the rollout worker's hand-off.
        await self.consumer.publish_and_ack(self.keys.scored, scored, fields, entry)
        self.metrics.observe(scored)

    async def run(self) -> None:
        self.stream_worker.install_signal_handlers()
        await self.stream_worker.run()
