"""Rollout worker against a real redis-server: router down or failing -> the group is published
with failure_reason after bounded retries and the worker goes on; the `millstream rollout`
process reads its config from Redis, generates through the real router and engine, carries
the trace on, and drains on SIGTERM. The one stand-in, `RouterAnswering(500)`, is a router
whose every /generate fails: a failure the real router does not produce on demand."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from millstream.common.config import parse_run_config
from millstream.common.config import store as config_store
from millstream.common.keys import GROUP_ROLLOUT, RunKeys
from millstream.common.redis_conn import connect
from millstream.common.retry import Backoff
from millstream.common.streams import publish
from millstream.common.types import PromptGroup, SampleGroup, SampleStatus
from millstream.rollout.client import RouterClient
from millstream.rollout.worker import RolloutWorker
from millstream.tools.trace_cli import read_spans
from tests.support.engine_proc import EngineProcess
from tests.support.prom import metrics_url, scrape_until
from tests.support.redis_server import free_port
from tests.support.rollout_proc import (
    RolloutProcs,
    RouterAnswering,
    pending_count,
    publish_prompts,
    read_stream,
)
from tests.support.router_proc import start_router

pytestmark = pytest.mark.integration

PROMPT = [11, 12, 13, 14]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
TRACE = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01", "tracestate": ""}


def as_batch(value):
    return value if isinstance(value, list) else [value]


def run_config(run_id: str, router_url: str, *flags: str):
    return parse_run_config(
        ["--run-id", run_id, "--router-url", router_url, "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
         "--stream-block-ms", "50", *flags],
        mode="async",
    )  # fmt: skip


def groups(n: int) -> list[PromptGroup]:
    return [
        PromptGroup(
            group_id=f"g{i}",
            data_index=i,
            prompt_token_ids=PROMPT,
            n_samples=2,
            admitted_unix=time.time(),
        )
        for i in range(n)
    ]


def in_process_failures(redis_url: str, router_url: str) -> tuple[list[SampleGroup], bool]:
    """Run a worker in this process; publish one group, wait for its output, then another:
    returns both outputs and whether the worker was still running after them."""
    run_id = f"t{uuid.uuid4().hex[:8]}"
    keys = RunKeys(run_id)

    async def main() -> tuple[list[SampleGroup], bool]:
        redis = await connect(redis_url)
        client = RouterClient(
            router_url, max_concurrency=4, retry=Backoff(attempts=3, first_s=0.05)
        )
        worker = RolloutWorker(run_config(run_id, router_url), redis, client, "it")
        task = asyncio.create_task(worker.run())
        outputs: list[SampleGroup] = []
        try:
            for group in groups(2):
                await publish(redis, keys.prompts, group)
                while await redis.xlen(keys.generated) == len(outputs):
                    assert not task.done(), task
                    await asyncio.sleep(0.02)
                entries = await redis.xrange(keys.generated)
                outputs.append(SampleGroup.FromString(entries[-1][1][b"data"]))
            alive = not task.done()
            pending = await redis.xpending(keys.prompts, GROUP_ROLLOUT)
            assert pending["pending"] == 0  # both handed off (acked with their output)
        finally:
            worker.stop()
            await task
            await client.aclose()
            await redis.aclose()
        return outputs, alive

    return asyncio.run(main())


@pytest.mark.timeout(60)
def test_router_down_fails_the_group_with_the_reason_and_the_worker_goes_on(redis_url):
    outputs, alive = in_process_failures(redis_url, f"http://127.0.0.1:{free_port()}")
    assert alive
    assert [o.prompt.group_id for o in outputs] == ["g0", "g1"]
    for output in outputs:
        assert "failed 3 times" in output.failure_reason
        assert "ConnectError" in output.failure_reason and not output.samples


@pytest.mark.timeout(60)
def test_router_answering_500_fails_the_group_after_bounded_retries(redis_url):
    with RouterAnswering(500) as router:
        outputs, alive = in_process_failures(redis_url, router.url)
        attempts = len(router.generate_requests())
    assert alive
    assert all("HTTP 500" in o.failure_reason and not o.samples for o in outputs)
    # Two groups, two samples each, three attempts per sample at most (a failed sample
    # cancels its sibling, which may not have used all three).
    assert 6 <= attempts <= 12


@pytest.mark.timeout(120)
def test_rollout_process_generates_through_the_router_and_drains(
    redis_url, tiny_model_dir, tmp_path
):
    """The real path: a `millstream rollout` process, our router, our engine on the tiny
    model; the trace goes on from the prompt's stream entry into the engine's span."""
    run_id = f"t{uuid.uuid4().hex[:8]}"
    keys = RunKeys(run_id)
    procs = RolloutProcs(redis_url, run_id, tmp_path)
    engine = EngineProcess(tiny_model_dir, tmp_path, "--weight-version", "7", "--run-dir",
                           str(tmp_path))  # fmt: skip
    router = start_router(tmp_path, "--worker-urls", engine.url, "--run-dir", str(tmp_path))

    async def publish_config() -> None:
        redis = await connect(redis_url)
        try:
            await config_store.publish(redis, run_config(run_id, "http://unused:1"))
        finally:
            await redis.aclose()

    try:
        # Started before the config exists: it waits for the trainer to publish it.
        procs.start("r1", "--router-url", router.url, "--metrics-port", "0")
        procs.wait_for_log("r1", "waiting for the run config")
        asyncio.run(publish_config())
        procs.wait_ready("r1")
        publish_prompts(redis_url, keys.prompts, groups(3), TRACE)
        out = read_stream(redis_url, keys.generated, SampleGroup, 3, timeout_s=60)
        jobs = {"worker": "rollout[r1]", "stream": "prompts", "group": GROUP_ROLLOUT}
        metrics = scrape_until(
            metrics_url(procs.log("r1"), "rollout"),
            lambda m: m.value("millstream_worker_jobs_processed_total", **jobs) == 3,
        )
        assert procs.stop("r1") == 0, procs.log("r1")
    finally:
        procs.stop_all()
        router.stop()
        engine.stop()

    assert sorted(g.prompt.group_id for g, _ in out) == ["g0", "g1", "g2"]
    for group, fields in out:
        assert not group.failure_reason and group.timings["rollout"] > 0
        assert 0 <= group.timings["rollout_queue"] < 60
        assert fields[b"traceparent"].decode().split("-")[1] == TRACE_ID
        assert len(group.samples) == 2
        for sample in group.samples:
            length = len(sample.response_token_ids)
            assert 1 <= length <= 6 and len(sample.rollout_logprobs) == length
            assert all(lp <= 0 for lp in sample.rollout_logprobs)
            assert list(sample.weight_versions) == [7] * length  # the engine's version
            truncated = sample.status == SampleStatus.SAMPLE_STATUS_TRUNCATED
            assert truncated == (length == 6), (length, sample.status)
    # One prompt per group with n = 2 (parallel sampling): 6 samples from 3 prompts in at most
    # 3 engine requests (prompts claimed together go out together, client.py), each carrying
    # the groups' trace on through the router.
    spans, _ = read_spans(tmp_path)
    generations = [s for s in spans if s.service == "engine" and s.stage == "engine"]
    assert 1 <= len(generations) <= 3, generations
    assert sum(s.attrs["millstream.sequences"] for s in generations) == 6
    assert {s.trace_id for s in generations} == {TRACE_ID}
    assert {s.trace_id for s in spans if s.service == "router"} == {TRACE_ID}
    assert pending_count(redis_url, keys.prompts, GROUP_ROLLOUT) == 0
    assert metrics.value("millstream_rollout_group_duration_seconds_count") == 3
    assert metrics.value("millstream_rollout_group_duration_seconds_sum") > 0
    assert metrics.value("millstream_rollout_queue_wait_seconds_count") == 3
    assert metrics.value("millstream_rollout_groups_failed_total") == 0
    assert metrics.value("millstream_worker_jobs_failed_total", **jobs) == 0
    queue = {"run": run_id, "stream": "prompts", "group": GROUP_ROLLOUT}
    assert metrics.value("millstream_stream_lag_entries", **queue) == 0
    assert metrics.value("millstream_stream_pending_entries", **queue) == 0
