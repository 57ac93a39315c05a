"""`--reward-executor celery`: a real Celery worker process (`millstream reward-celery`) and a
reward worker process give the same verdicts and rewards as inline scoring of the same groups;
with no Celery worker, groups fail on the timeout instead of being scored 0."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid

import pytest

from millstream.common.config import parse_run_config
from millstream.common.telemetry import GROUP_ID, STAGE
from millstream.common.types import PromptGroup, Sample, SampleGroup, Verdict
from millstream.reward.rewarder import Rewarder
from millstream.reward.scorer import GroupScorer
from millstream.reward.worker import build_executor
from tests.support.redis_server import RedisServer
from tests.support.reward_proc import RewardProcs, collect_scored, publish_config, publish_groups

pytestmark = pytest.mark.integration

ANSWERS = ["\\boxed{\\frac{1}{2}}", "0.5", "so \\boxed{0.7}", "\\boxed{\\dfrac{2}{4}}", "x"]


def make_cfg(run_id: str, *flags: str):
    return parse_run_config(
        ["--run-id", run_id, "--rollout-batch-size", "1", "--stream-block-ms", "100",
         "--rm-type", "math", "--reward-executor", "celery", "--reward-retries", "0",
         "--rm-compat", "millstream", *flags],  # ANSWERS has unboxed ones: millstream's math
        mode="async",
    )  # fmt: skip


def make_groups() -> list[SampleGroup]:
    rows = [[ANSWERS[(g + i) % len(ANSWERS)] for i in range(3)] for g in range(5)]
    rows += [["\\boxed{0.5}", "1/2"], ["0.5", "\\boxed{0.5}"]]  # all right: filtered; failed
    groups = [
        SampleGroup(
            prompt=PromptGroup(group_id=f"c{g}", prompt_text="half?"),
            samples=[
                Sample(group_id=f"c{g}", index=i, response_text=r, label="1/2")
                for i, r in enumerate(responses)
            ],
        )
        for g, responses in enumerate(rows)
    ]
    # An error raised on the Celery worker must come back as a failed group with its reason.
    groups[-1].samples[0].metadata_json = '{"rm_type": "remote_rm"}'
    return groups


def score_inline(cfg, groups):
    cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, reward_executor="inline"))

    async def go():
        rewarder = Rewarder(cfg)
        scorer = GroupScorer(cfg, rewarder)
        return {g.prompt.group_id: await scorer.score(g) for g in groups}

    return asyncio.run(go())


@pytest.mark.timeout(90)
def test_celery_executor_gives_the_same_results_as_inline(redis_url, tmp_path):
    run_id = f"cel{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    cfg = make_cfg(
        run_id,
        "--dynamic-sampling-filter-path",
        "check_reward_nonzero_std",
        "--run-dir",
        str(run_dir),
    )
    asyncio.run(publish_config(redis_url, cfg))
    procs = RewardProcs(redis_url, run_id, tmp_path)
    try:
        procs.celery("celery", "--pool", "threads", "--concurrency", "3", "--log-level", "info")
        procs.reward("rw-c")
        procs.wait_for_log("celery", "ready.")
        groups = make_groups()

        async def go():
            from millstream.common.redis_conn import connect

            redis = await connect(redis_url)
            try:
                await publish_groups(redis, run_id, groups)
                scored = await collect_scored(redis, run_id, len(groups), timeout_s=45)
                binding = await redis.exists(
                    f"{run_id}:celery:_kombu.binding.millstream.reward.{run_id}"
                )
                return scored, binding
            finally:
                await redis.aclose()

        scored, binding = asyncio.run(go())
        assert binding, "the Celery queue was never bound under the run's key prefix"
        via_celery = {s.group.prompt.group_id: s for s, _ in scored}
        assert len(scored) == len(via_celery) == len(groups)
        inline = score_inline(cfg, groups)
        for gid, want in inline.items():
            got = via_celery[gid]
            assert got.verdict == want.verdict, (gid, got.reason, want.reason)
            assert [s.reward for s in got.group.samples] == [s.reward for s in want.group.samples]
            if want.verdict == Verdict.VERDICT_FAILED:
                assert "needs --rm-url" in got.reason and "needs --rm-url" in want.reason
            else:
                assert got.reason == want.reason
        verdicts = {s.verdict for s in inline.values()}
        assert verdicts == {Verdict.VERDICT_KEPT, Verdict.VERDICT_FILTERED, Verdict.VERDICT_FAILED}
        assert procs.stop("rw-c") == 0
        assert procs.stop("celery") == 0
    finally:
        procs.stop_all()
    # The Celery task's span continues the reward worker's trace of the group.
    lines = [
        json.loads(x) for f in tmp_path.rglob("traces/*.jsonl") for x in f.read_text().splitlines()
    ]
    spans = {
        name: [x for x in lines if x["service"] == name] for name in ("reward", "reward-celery")
    }
    scoring = {s["span_id"]: s for s in spans["reward"] if s["attributes"].get(STAGE) == "reward"}
    tasks = [s for s in spans["reward-celery"] if s["attributes"].get(STAGE) == "reward_task"]
    assert tasks and all(t["parent_span_id"] in scoring for t in tasks)
    assert {scoring[t["parent_span_id"]]["trace_id"] for t in tasks} == {
        t["trace_id"] for t in tasks
    }
    assert len({scoring[t["parent_span_id"]]["attributes"][GROUP_ID] for t in tasks}) == len(groups)


@pytest.mark.timeout(30)
def test_no_celery_worker_means_failed_groups_not_zero_rewards(redis_url):
    cfg = make_cfg(f"cel{uuid.uuid4().hex[:8]}", "--reward-timeout", "0.5")

    async def go():
        executor = build_executor(cfg, redis_url, None)
        try:
            return await GroupScorer(cfg, executor).score(make_groups()[0])
        finally:
            await executor.aclose()

    out = asyncio.run(go())
    assert out.verdict == Verdict.VERDICT_FAILED
    assert "timed out after 0.5 s" in out.reason


@pytest.mark.timeout(120)
def test_a_redis_outage_is_waited_out_not_a_failed_reward(tmp_path):
    """Redis down 8 s, longer than --reward-timeout, while a group is scored through Celery
    with --reward-retries 0: the group is scored once Redis is back (before: "timed out after
    5 s", FAILED: the outage counted against the reward's own bound)."""
    server = RedisServer(tmp_path, appendonly=True)
    run_id = f"cel{uuid.uuid4().hex[:8]}"
    cfg = make_cfg(run_id, "--reward-timeout", "5")
    asyncio.run(publish_config(server.url, cfg))
    procs = RewardProcs(server.url, run_id, tmp_path)
    groups = make_groups()
    try:
        procs.celery("celery", "--pool", "threads", "--concurrency", "3", "--log-level", "info")
        procs.wait_for_log("celery", "ready.")

        async def go():
            executor = build_executor(cfg, server.url, None)
            try:
                scorer = GroupScorer(cfg, executor)
                before = await scorer.score(groups[0])
                server.proc.terminate()
                server.proc.wait(timeout=10)
                threading.Timer(8.0, server.start).start()
                started = time.monotonic()
                during = await scorer.score(groups[1])
                return before, during, time.monotonic() - started
            finally:
                await executor.aclose()

        before, during, waited = asyncio.run(go())
    finally:
        procs.stop_all()
        server.stop()
    assert before.verdict != Verdict.VERDICT_FAILED, before.reason
    assert during.verdict != Verdict.VERDICT_FAILED, during.reason
    assert waited >= 7.5  # the outage was met, not missed
    want = score_inline(cfg, groups[1:2])["c1"]
    assert [s.reward for s in during.group.samples] == [s.reward for s in want.group.samples]
