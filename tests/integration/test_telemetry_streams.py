"""A span context injected into a real stream entry comes out as the parent on the consumer side."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from millstream.common import streams, telemetry
from millstream.common.keys import GROUP_ROLLOUT, RunKeys
from millstream.common.redis_conn import connect
from millstream.common.types import PromptGroup

pytestmark = pytest.mark.integration


def test_trace_context_crosses_a_redis_stream(redis_url):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    keys = RunKeys("tele")

    async def go():
        redis = await connect(redis_url)
        try:
            consumer = streams.Consumer(
                redis, keys.prompts, GROUP_ROLLOUT, "c1",
                claim_idle_ms=60_000, max_deliveries=3, dead_stream=keys.dead, block_ms=500,
            )  # fmt: skip
            await consumer.ensure_group()
            with tracer.start_as_current_span("admit") as admit:
                await streams.publish(
                    redis, keys.prompts, PromptGroup(group_id="g"), telemetry.inject_fields()
                )
            (entry,) = await consumer.read(count=1)
            parent = telemetry.context_from_fields(entry.trace_fields)
            with tracer.start_as_current_span("rollout", context=parent):
                pass
            await consumer.ack(entry)
            return admit.get_span_context()
        finally:
            await redis.aclose()

    admit_ctx = asyncio.run(go())
    rollout = next(s for s in exporter.get_finished_spans() if s.name == "rollout")
    assert rollout.parent.span_id == admit_ctx.span_id
    assert rollout.context.trace_id == admit_ctx.trace_id
