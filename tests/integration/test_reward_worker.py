"""Reward worker processes against a real redis-server: every group scored exactly once (also
when a worker is SIGKILLed mid-stream), failures become FAILED groups while the worker goes on,
and gRPC Reward.Score answers what the stream path publishes."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path

import grpc
import pytest

from millstream.common.config import parse_run_config
from millstream.common.keys import GROUP_REWARD, RunKeys
from millstream.common.pb import services_pb2, services_pb2_grpc
from millstream.common.redis_conn import connect
from millstream.common.telemetry import STAGE
from millstream.common.types import PromptGroup, Sample, SampleGroup, Verdict
from tests.support.prom import metrics_url, scrape_until
from tests.support.redis_server import free_port
from tests.support.reward_proc import RewardProcs, collect_scored, publish_config, publish_groups

pytestmark = pytest.mark.integration

PLUGINS = "tests.support.reward_plugins"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"
TRACE = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01", "tracestate": ""}


@pytest.fixture
def run_id() -> str:
    return f"rw{uuid.uuid4().hex[:8]}"


@pytest.fixture
def procs(redis_url, run_id, tmp_path):
    p = RewardProcs(redis_url, run_id, tmp_path)
    yield p
    p.stop_all()


def make_cfg(run_id: str, *flags: str):
    return parse_run_config(
        ["--run-id", run_id, "--rollout-batch-size", "1", "--stream-block-ms", "100", *flags],
        mode="async",
    )


def group(gid: str, responses: list[str], labels: list[str]) -> SampleGroup:
    return SampleGroup(
        prompt=PromptGroup(group_id=gid, prompt_text=f"question {gid}", n_samples=len(responses)),
        samples=[
            Sample(group_id=gid, index=i, response_text=r, label=lab)
            for i, (r, lab) in enumerate(zip(responses, labels, strict=True))
        ],
    )


def arun(redis_url: str, fn):
    async def go():
        redis = await connect(redis_url)
        try:
            return await fn(redis)
        finally:
            await redis.aclose()

    return asyncio.run(go())


@pytest.mark.timeout(90)
def test_two_workers_every_group_exactly_once_even_after_a_sigkill(redis_url, run_id, procs):
    cfg = make_cfg(
        run_id,
        "--custom-rm-path", f"{PLUGINS}.slow_exact",
        "--claim-idle-ms", "1000",
        "--reward-max-concurrency", "3",
    )  # fmt: skip
    asyncio.run(publish_config(redis_url, cfg))
    for name in ("rw-a", "rw-b"):
        procs.reward(name)
    for name in ("rw-a", "rw-b"):
        procs.wait_for_log(name, "consuming")
    n = 30
    groups = [group(f"g{i}", ["yes", "no"], ["yes", "yes"]) for i in range(n)]
    keys = RunKeys(run_id)

    async def go(redis):
        await publish_groups(redis, run_id, groups, TRACE)
        while await redis.xlen(keys.scored) < 6:
            await asyncio.sleep(0.02)
        procs.stop("rw-a", signal.SIGKILL)
        consumers = await redis.xinfo_consumers(keys.generated, GROUP_REWARD)
        left_pending = {c["name"].decode(): c["pending"] for c in consumers}
        scored = await collect_scored(redis, run_id, n, timeout_s=60)
        return left_pending, scored, await redis.xlen(keys.dead)

    left_pending, scored, dead = arun(redis_url, go)
    assert left_pending["rw-a"] > 0, "the killed worker had no work in flight"
    ids = [s.group.prompt.group_id for s, _ in scored]
    assert sorted(ids) == sorted(g.prompt.group_id for g in groups), "not exactly once"
    assert dead == 0
    for s, fields in scored:
        assert s.verdict == Verdict.VERDICT_KEPT
        assert [x.reward for x in s.group.samples] == [1.0, 0.0]
        assert s.group.timings["reward"] > 0
        assert fields[b"traceparent"].decode().split("-")[1] == TRACE_ID
    assert procs.stop("rw-b") == 0
    assert "stopped" in procs.log("rw-b")


@pytest.mark.timeout(60)
def test_failures_become_failed_groups_and_the_worker_goes_on(redis_url, run_id, procs):
    cfg = make_cfg(
        run_id,
        "--custom-rm-path", f"{PLUGINS}.misbehaving",
        "--reward-timeout", "0.5",
        "--reward-retries", "1",
    )  # fmt: skip
    procs.reward("rw-f", "--metrics-port", "0")  # before the config: it waits for it
    procs.wait_for_log("rw-f", "waiting for the run config")
    asyncio.run(publish_config(redis_url, cfg))
    groups = [
        group("boom", ["x", "y"], ["y", "boom"]),
        group("hang", ["x"], ["hang"]),
        group("flaky", ["x"], ["flaky"]),
        group("good", ["a", "b"], ["a", "a"]),
    ]
    keys = RunKeys(run_id)

    async def go(redis):
        await publish_groups(redis, run_id, groups)
        await redis.xadd(keys.generated, {"data": b"\xff not protobuf", "v": "1"})
        scored = await collect_scored(redis, run_id, len(groups), timeout_s=30)
        for _ in range(100):
            if await redis.xlen(keys.dead):
                break
            await asyncio.sleep(0.05)
        return scored, await redis.xlen(keys.dead)

    scored, dead = arun(redis_url, go)
    by_id = {s.group.prompt.group_id: s for s, _ in scored}
    assert len(scored) == len(groups) == len(by_id)
    assert by_id["boom"].verdict == Verdict.VERDICT_FAILED
    # A raising plugin: failed at once with its error, not retried (common/plugin_errors.py).
    assert by_id["boom"].reason.startswith(f"reward: --custom-rm-path {PLUGINS}.misbehaving raised")
    assert by_id["boom"].plugin_error.type == "RuntimeError"
    assert by_id["hang"].verdict == Verdict.VERDICT_FAILED
    assert "timed out after 0.5 s" in by_id["hang"].reason
    assert by_id["flaky"].verdict == Verdict.VERDICT_KEPT
    assert [x.reward for x in by_id["flaky"].group.samples] == [1.0]
    assert by_id["good"].verdict == Verdict.VERDICT_KEPT
    assert [x.reward for x in by_id["good"].group.samples] == [1.0, 0.0]
    assert dead == 1  # the undecodable entry, dead-lettered rather than scored
    assert procs.procs["rw-f"].poll() is None, "the worker died"
    # /metrics says the same: verdicts, per-group seconds, attempts, jobs, the queue.
    jobs = {"worker": "rw-f", "stream": "generated", "group": "reward"}
    m = scrape_until(
        metrics_url(procs.log("rw-f"), "reward"),
        lambda m: m.value("millstream_worker_jobs_processed_total", **jobs) == len(groups),
    )
    assert m.value("millstream_reward_groups_total", verdict="failed") == 2
    assert m.value("millstream_reward_groups_total", verdict="kept") == 2
    assert m.value("millstream_reward_groups_total", verdict="filtered") == 0
    assert m.value("millstream_reward_group_duration_seconds_count") == len(groups)
    assert m.value("millstream_reward_group_duration_seconds_sum") >= 1.0  # hang: 2 x 0.5 s
    assert m.value("millstream_reward_attempts_failed_total", reason="timeout") == 2
    assert m.value("millstream_reward_attempts_failed_total", reason="error") == 1  # flaky
    assert m.value("millstream_reward_attempts_failed_total", reason="plugin") == 1  # boom
    assert m.value("millstream_reward_retries_total") == 2  # hang, flaky
    assert m.value("millstream_worker_jobs_failed_total", **jobs) == 0
    assert m.value("millstream_worker_entries_dead_lettered_total", **jobs) == 1
    assert m.value("millstream_worker_jobs_in_flight", **jobs) == 0
    queue = {"run": run_id, "stream": "generated"}
    assert m.value("millstream_stream_entries", **queue) == len(groups) + 1
    assert m.value("millstream_stream_lag_entries", **queue, group="reward") == 0
    assert m.value("millstream_stream_pending_entries", **queue, group="reward") == 0
    assert procs.stop("rw-f") == 0
    log = procs.log("rw-f")
    assert "'failed': 2" in log and "'reward_retries': 2" in log, log
    assert "'plugin_failed': 1" in log, log


@pytest.mark.timeout(60)
def test_miles_plugins_as_miles_docs_write_them_score_and_filter(redis_url, run_id, procs):
    """A reward `async fn(args, sample)` and a filter `fn(args, samples, **kwargs) ->
    DynamicFilterOutput` (tests/support/miles_plugins.py), through a reward worker process."""
    cfg = make_cfg(
        run_id,
        "--custom-rm-path", "tests.support.miles_plugins.custom_rm",
        "--dynamic-sampling-filter-path", "tests.support.miles_plugins.filter_function",
        "--reward-retries", "0",
    )  # fmt: skip
    asyncio.run(publish_config(redis_url, cfg))
    procs.reward("rw-m")
    bonus = group("bonus", ["a", "b"], ["a", "a"])
    bonus.samples[1].metadata_json = json.dumps({"bonus": 0.5})
    groups = [group("mixed", ["a", "b"], ["a", "a"]), group("same", ["a", "a"], ["a", "a"]), bonus]

    async def go(redis):
        await publish_groups(redis, run_id, groups)
        return await collect_scored(redis, run_id, len(groups), timeout_s=30)

    by_id = {s.group.prompt.group_id: s for s, _ in arun(redis_url, go)}
    assert by_id["mixed"].verdict == Verdict.VERDICT_KEPT, by_id["mixed"].reason
    assert [x.reward for x in by_id["mixed"].group.samples] == [1.0, 0.0]
    assert by_id["same"].verdict == Verdict.VERDICT_FILTERED
    assert by_id["same"].reason == "zero_std_1.0"
    assert [x.reward for x in by_id["bonus"].group.samples] == [1.0, 0.5]
    assert procs.stop("rw-m") == 0


@pytest.mark.timeout(60)
def test_grpc_score_answers_what_the_stream_path_publishes(redis_url, run_id, procs, tmp_path):
    cfg = make_cfg(
        run_id, "--rm-type", "math", "--dynamic-sampling-filter-path", "check_reward_nonzero_std",
        "--rm-compat", "millstream",  # "so 4.0" is right only in millstream's lenient reading
    )  # fmt: skip
    asyncio.run(publish_config(redis_url, cfg))
    port = free_port()
    procs.reward("rw-g", "--grpc-port", str(port))
    groups = [
        group("mixed", ["\\boxed{\\frac{1}{2}}", "0.7"], ["0.5", "0.5"]),
        group("same", ["\\boxed{4}", "so 4.0"], ["4", "4"]),
        group("gave-up", [], []),
    ]
    groups[2].failure_reason = "router unreachable"

    async def via_stream(redis):
        await publish_groups(redis, run_id, groups, TRACE)
        return await collect_scored(redis, run_id, len(groups), timeout_s=30)

    async def via_grpc():
        procs.wait_for_log("rw-g", "gRPC Reward.Score on port")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = services_pb2_grpc.RewardStub(channel)
            return [
                (
                    await stub.Score(
                        services_pb2.ScoreRequest(group=g), metadata=tuple(TRACE.items())
                    )
                ).scored
                for g in groups
            ]

    streamed = {s.group.prompt.group_id: s for s, _ in arun(redis_url, via_stream)}
    answered = asyncio.run(via_grpc())
    assert len(streamed) == len(groups)
    for got in answered:
        want = streamed[got.group.prompt.group_id]
        assert (got.verdict, got.reason) == (want.verdict, want.reason)
        assert [x.reward for x in got.group.samples] == [x.reward for x in want.group.samples]
    assert [s.verdict for s in answered] == [
        Verdict.VERDICT_KEPT,
        Verdict.VERDICT_FILTERED,
        Verdict.VERDICT_FAILED,
    ]
    assert answered[2].reason == "router unreachable"
    assert procs.stop("rw-g") == 0
    spans = [
        json.loads(line)
        for path in Path(tmp_path, "traces").glob("reward-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    scored_spans = [s for s in spans if s["attributes"].get(STAGE) == "reward"]
    assert len(scored_spans) == 2 * len(groups)  # stream + gRPC, each a child of the caller
    assert {(s["trace_id"], s["parent_span_id"]) for s in scored_spans} == {(TRACE_ID, PARENT_SPAN)}
    # Named as OpenTelemetry's messaging and RPC conventions say.
    names = sorted({s["name"] for s in scored_spans})
    assert names == ["millstream.v1.Reward/Score", f"process {run_id}:generated"]
    waits = [s for s in spans if s["attributes"].get(STAGE) == "generated_wait"]
    assert len(waits) == len(groups) and all(w["end_ns"] >= w["start_ns"] for w in waits)


@pytest.mark.timeout(90)
def test_a_worker_rides_out_a_redis_restart_and_exits_with_one_line_when_it_is_gone(
    run_id, tmp_path
):
    """Redis away for 5 s while groups are scored (AOF on, restarted on its port): the worker
    says so once, reconnects, hands off what it held and scores on, every group exactly once.
    Redis gone for good: the worker exits 1 after --redis-outage-timeout, with one line naming
    Redis, no traceback."""
    from tests.support.redis_server import RedisServer

    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", appendonly=True)
    procs = RewardProcs(server.url, run_id, tmp_path)
    keys = RunKeys(run_id)
    cfg = make_cfg(
        run_id, "--custom-rm-path", f"{PLUGINS}.slow_exact", "--redis-outage-timeout", "8"
    )  # fmt: skip
    before = [group(f"b{i}", ["4", "5"], ["4", "4"]) for i in range(20)]
    after = [group(f"a{i}", ["4"], ["4"]) for i in range(5)]
    try:
        asyncio.run(publish_config(server.url, cfg))
        worker = procs.reward("reward-0")
        procs.wait_beating("reward", "reward-0")

        async def until_some_scored(redis):
            await publish_groups(redis, run_id, before)
            while await redis.xlen(keys.scored) < 3:
                await asyncio.sleep(0.02)

        arun(server.url, until_some_scored)
        server.restart(down_s=5.0)
        back = time.monotonic()

        async def score_the_rest(redis):
            await publish_groups(redis, run_id, after)
            scored = await collect_scored(redis, run_id, len(before) + len(after), timeout_s=30)
            return scored, (await redis.xpending(keys.generated, GROUP_REWARD))["pending"]

        scored, pending = arun(server.url, score_the_rest)
        resumed_s = time.monotonic() - back
        ids = sorted(s.group.prompt.group_id for s, _ in scored)
        assert ids == sorted(g.prompt.group_id for g in before + after), "not exactly once"
        assert pending == 0 and worker.poll() is None
        log = procs.log("reward-0")
        assert log.count("[reward-0] Redis at redis://127.0.0.1:") == 2, log
        assert log.count("connection lost") == 1 and log.count("reconnected after") == 1, log
        print(f"5 s restart: the rest scored {resumed_s:.1f} s after Redis was back")
        server.stop()
        gone = time.monotonic()
        assert worker.wait(timeout=30) == 1
        assert 8 <= time.monotonic() - gone < 20
    finally:
        procs.stop_all()
        server.stop()
    log = procs.log("reward-0")
    assert f"Redis at redis://127.0.0.1:{server.port}/0 is unreachable" in log, log
    assert "--redis-outage-timeout 8); giving up" in log, log
    assert "Traceback" not in log and "never retrieved" not in log, log
