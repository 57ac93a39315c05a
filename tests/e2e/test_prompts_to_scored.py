"""Prompts in, scored groups out: real redis-server, one engine (tiny model), the router,
two rollout workers and two reward workers, all real processes. Every group arrives on
{run}:scored exactly once, with logprobs and weight versions on every sample and the trace
of its prompt entry carried through; also when a rollout worker and a reward worker are
SIGKILLed mid-stream (the others take their pending entries over)."""

from __future__ import annotations

import asyncio
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from millstream.common.config import parse_run_config
from millstream.common.keys import GROUP_REWARD, GROUP_ROLLOUT, RunKeys
from millstream.common.types import PromptGroup, SampleGroup, ScoredGroup, Verdict
from tests.support.engine_proc import EngineProcess
from tests.support.reward_proc import RewardProcs, publish_config
from tests.support.rollout_proc import RolloutProcs, publish_prompts, read_stream
from tests.support.router_proc import ServiceProcess, start_router

pytestmark = pytest.mark.e2e

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01", "tracestate": ""}


@pytest.fixture(scope="module")
def router(tiny_model_dir: Path, tmp_path_factory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("serving")
    engine = EngineProcess(tiny_model_dir, workdir, "--weight-version", "0", startup_timeout_s=180)
    try:
        proc = start_router(workdir, "--worker-urls", engine.url, "--health-check-interval", "1")
        try:
            yield proc
        finally:
            proc.stop()
    finally:
        engine.stop()


class Run:
    """One run's config, prompts, and its two rollout and two reward workers."""

    def __init__(self, redis_url: str, router_url: str, workdir: Path, *flags: str):
        self.redis_url = redis_url
        self.run_id = f"e{uuid.uuid4().hex[:8]}"
        self.keys = RunKeys(self.run_id)
        cfg = parse_run_config(
            ["--run-id", self.run_id, "--router-url", router_url, "--rollout-batch-size", "4",
             "--n-samples-per-prompt", "2", "--rollout-temperature", "1.0",
             "--rm-type", "exact", "--stream-block-ms", "100", *flags],
            mode="async",
        )  # fmt: skip
        asyncio.run(publish_config(redis_url, cfg))
        self.rollout = RolloutProcs(redis_url, self.run_id, workdir)
        self.reward = RewardProcs(redis_url, self.run_id, workdir)

    def start_workers(self) -> None:
        for name in ("r1", "r2"):
            self.rollout.start(name)
        for name in ("w1", "w2"):
            self.reward.reward(name)
        for name in ("r1", "r2"):
            self.rollout.wait_ready(name)
        for name in ("w1", "w2"):
            self.reward.wait_for_log(name, "consuming", timeout_s=60)

    def publish(self, n: int, first: int = 0) -> list[str]:
        groups = [
            PromptGroup(
                group_id=f"g{i}",
                data_index=i,
                prompt_token_ids=[65 + i % 26, 66, 67, 10 + i],
                prompt_text=f"prompt {i}",
                label="abc",
                admitted_version=0,
            )
            for i in range(first, first + n)
        ]
        publish_prompts(self.redis_url, self.keys.prompts, groups, TRACE)
        return [g.group_id for g in groups]

    def pending(self, stream: str, group: str, consumer: str) -> int:
        client = redis.Redis.from_url(self.redis_url)
        try:
            rows = client.xpending_range(stream, group, "-", "+", 1000, consumername=consumer)
            return len(rows)
        finally:
            client.close()

    def count(self, stream: str) -> int:
        client = redis.Redis.from_url(self.redis_url)
        try:
            return int(client.xlen(stream))
        finally:
            client.close()

    def stop(self) -> None:
        self.rollout.stop_all()
        self.reward.stop_all()

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{p.log(name)[-3000:]}"
            for p in (self.rollout, self.reward)
            for name in p.procs
        )


def check_exactly_once(run: Run, ids: list[str], scored: list[tuple[ScoredGroup, dict]]) -> None:
    got = [s.group.prompt.group_id for s, _ in scored]
    assert sorted(got) == sorted(ids), f"scored {sorted(got)}\n{run.logs()}"
    generated = read_stream(run.redis_url, run.keys.generated, SampleGroup, len(ids), 1, 0)
    assert sorted(g.prompt.group_id for g, _ in generated) == sorted(ids)
    client = redis.Redis.from_url(run.redis_url)
    try:
        assert client.xlen(run.keys.dead) == 0
    finally:
        client.close()
    for s, fields in scored:
        assert s.verdict == Verdict.VERDICT_KEPT, s
        assert fields[b"traceparent"].decode().split("-")[1] == TRACE_ID
        assert not s.group.failure_reason and len(s.group.samples) == 2
        for sample in s.group.samples:
            n = len(sample.response_token_ids)
            assert n > 0 and len(sample.rollout_logprobs) == n
            assert list(sample.weight_versions) == [0] * n and list(sample.loss_mask) == [1] * n
            assert all(lp <= 0 for lp in sample.rollout_logprobs)


@pytest.mark.timeout(180)
def test_prompts_become_scored_groups_exactly_once(router, redis_url, tmp_path):
    run = Run(
        redis_url,
        router.url,
        tmp_path,
        "--rollout-max-response-len", "16",
        "--rollout-max-concurrency", "4",
    )  # fmt: skip
    try:
        run.start_workers()
        ids = run.publish(8)
        scored = read_stream(redis_url, run.keys.scored, ScoredGroup, len(ids), 60)
        check_exactly_once(run, ids, scored)
        # Both rollout workers took part (4 group slots each), and both drain on SIGTERM.
        for name in ("r1", "r2"):
            assert run.rollout.stop(name) == 0, run.logs()
            processed = re.search(r"processed (\d+)", run.rollout.log(name))
            assert processed and int(processed.group(1)) > 0, run.logs()
    finally:
        run.stop()


@pytest.mark.timeout(180)
def test_every_group_arrives_once_after_workers_are_sigkilled(router, redis_url, tmp_path):
    run = Run(
        redis_url,
        router.url,
        tmp_path,
        "--rollout-max-response-len", "64",
        "--rollout-max-concurrency", "4",
        "--claim-idle-ms", "1000",
    )  # fmt: skip
    try:
        run.start_workers()
        ids = run.publish(12)
        # Mid-stream: some groups are through, and the victim rollout worker holds groups it
        # has not handed off yet.
        deadline = time.monotonic() + 60
        while (
            run.count(run.keys.generated) < 2
            or run.pending(run.keys.prompts, GROUP_ROLLOUT, "r1") == 0
        ):
            assert time.monotonic() < deadline, run.logs()
            if run.count(run.keys.generated) >= len(ids):  # all through before r1 was seen
                ids += run.publish(12, first=len(ids))  # holding one: more work, look again
            time.sleep(0.02)
        run.rollout.kill("r1")
        # Read after the kill: what the dead worker still holds (it may have acked some of
        # what it held a moment ago; the engine is fast).
        held = run.pending(run.keys.prompts, GROUP_ROLLOUT, "r1")
        run.reward.stop("w1", signal.SIGKILL)
        scored = read_stream(redis_url, run.keys.scored, ScoredGroup, len(ids), 90)
        check_exactly_once(run, ids, scored)
        assert held > 0
        assert run.pending(run.keys.prompts, GROUP_ROLLOUT, "r1") == 0  # taken over by r2
        assert run.pending(run.keys.generated, GROUP_REWARD, "w1") == 0
    finally:
        run.stop()
