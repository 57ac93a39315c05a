"""The trainer's buffer on a real stream: one terminal state per group id, duplicates ignored
(also ids consumed before a restart), staleness drops, eval groups routed to their waiter."""

from __future__ import annotations

import asyncio

import pytest

from millstream.common import streams
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect
from millstream.common.types import PromptGroup, Sample, SampleGroup, ScoredGroup, Verdict
from millstream.trainer.buffer import Buffer, group_lag

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def scored(
    gid: str, verdict: int = Verdict.VERDICT_KEPT, versions=(3, 3), is_eval: bool = False
) -> ScoredGroup:
    sample = Sample(
        group_id=gid, response_token_ids=[1] * len(versions), weight_versions=list(versions)
    )
    prompt = PromptGroup(group_id=gid, is_eval=is_eval)
    return ScoredGroup(group=SampleGroup(prompt=prompt, samples=[sample]), verdict=verdict)


def test_group_lag_is_measured_from_the_oldest_token():
    assert group_lag(scored("g", versions=(2, 5)), version=6) == 4
    assert group_lag(scored("g", versions=()), version=6) == 0


def test_buffer_accounts_every_group_once(redis_url):
    keys = RunKeys("buf")
    ended: list[tuple[str, str]] = []

    async def go() -> tuple[list[str], list[str], int]:
        redis = await connect(redis_url)
        buffer = Buffer(
            redis, keys, "trainer-test", claim_idle_ms=60_000, max_deliveries=3, block_ms=200,
            on_terminal=lambda gid, state: ended.append((gid, state)), consumed={"old"},
        )  # fmt: skip
        await buffer.start()
        try:
            messages = [
                scored("a"), scored("b", Verdict.VERDICT_FILTERED), scored("c", Verdict.VERDICT_FAILED),
                scored("stale", versions=(0, 1)), scored("a"), scored("old"), scored("d"),
                scored("e1", is_eval=True), scored("e2", is_eval=True),
            ]  # fmt: skip
            await streams.publish_many(redis, keys.scored, messages)
            batch = await asyncio.wait_for(buffer.take(2, version=3, max_lag=2), timeout=20)
            evals = await asyncio.wait_for(buffer.wait_eval(["e2", "e1"]), timeout=20)
            return (
                [g.group.prompt.group_id for g in batch],
                [g.group.prompt.group_id for g in evals],
                buffer.duplicates,
            )
        finally:
            await buffer.stop()
            await redis.aclose()

    batch, evals, duplicates = asyncio.run(go())
    assert batch == ["a", "d"]
    assert evals == ["e2", "e1"]
    assert duplicates == 2  # the second "a", and "old" consumed before a restart
    assert sorted(ended) == sorted(
        [
            ("a", "trained"),
            ("d", "trained"),
            ("b", "filtered"),
            ("c", "failed"),
            ("stale", "dropped_stale"),
        ]
    )
