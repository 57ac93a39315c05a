"""The trainer's long waits on a real Redis: progress lines name who is alive by heartbeat,
and a wait nobody can end fails naming what is missing and how to start it."""

from __future__ import annotations

import asyncio

import pytest

from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect
from millstream.trainer.janitor import Tidied, tidy
from millstream.trainer.observe.watch import Stalled, Watch, alive_workers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_a_wait_reports_progress_and_fails_when_no_worker_is_left(redis_url):
    keys = RunKeys("w*atch")  # a glob character in the run id must not widen the scan
    lines: list[str] = []

    async def go() -> tuple[str, dict[str, int], Stalled]:
        redis = await connect(redis_url)
        try:
            await redis.set(RunKeys("w-atch").heartbeat("rollout", "other-run"), "{}")
            await redis.set(keys.heartbeat("rollout", "r0"), "{}", px=1500)
            await redis.set(keys.heartbeat("reward", "w0"), "{}")
            await redis.set(keys.heartbeat("reward", "w1"), "{}")
            counts = await alive_workers(redis, keys)

            async def engines() -> list[str]:
                return ["http://engine"]

            watch = Watch(
                redis, keys, engines, stall_timeout_s=2.0, progress_every_s=0.5, say=lines.append
            )
            answer = await watch.wait("a quick thing", asyncio.sleep(0.1, result="done"))
            with pytest.raises(Stalled) as failed:
                await watch.wait("a batch", asyncio.Event().wait(), lambda: "3 in flight")
            return answer, counts, failed.value
        finally:
            await redis.aclose()

    answer, counts, err = asyncio.run(go())
    assert answer == "done"
    assert counts == {"rollout": 1, "reward": 2}
    assert any(
        "waiting" in line
        and "a batch (3 in flight)" in line
        and "rollout 1, reward 2, engine 1" in line
        for line in lines
    ), lines
    assert "no rollout worker is alive" in str(err) and "millstream rollout" in str(err)


def test_a_wait_fails_when_the_router_lists_no_engine(redis_url):
    keys = RunKeys("noengine")

    async def go() -> Stalled:
        redis = await connect(redis_url)
        try:
            await redis.set(keys.heartbeat("rollout", "r0"), "{}")
            await redis.set(keys.heartbeat("reward", "w0"), "{}")

            async def engines() -> list[str]:
                return []

            lines: list[str] = []
            watch = Watch(
                redis, keys, engines, stall_timeout_s=1.0, progress_every_s=0.5, say=lines.append
            )
            # A weight sync bounds itself: with no engine it reports progress, never Stalled.
            answer = await watch.wait("the weight sync", asyncio.sleep(1.6, "v1"), stall=False)
            assert answer == "v1" and any("waiting" in x and "the weight sync" in x for x in lines)
            with pytest.raises(Stalled) as failed:
                await watch.wait("a batch", asyncio.Event().wait())
            return failed.value
        finally:
            await redis.aclose()

    assert "no engine is routed" in str(asyncio.run(go()))


def test_the_janitor_trims_every_stream_of_the_run(redis_url):
    keys = RunKeys("tidy")

    async def go() -> tuple[Tidied, list[int]]:
        redis = await connect(redis_url)
        try:
            for stream in (keys.prompts, keys.generated, keys.scored, keys.dead):
                await redis.xgroup_create(stream, "g", id="0", mkstream=True)
                for _ in range(300):
                    await redis.xadd(stream, {"v": "1"})
                for entry_id, _ in (await redis.xreadgroup("g", "c", {stream: ">"}, count=300))[0][
                    1
                ]:
                    await redis.xack(stream, "g", entry_id)
            tidied = Tidied()
            await tidy(redis, keys, consumer_idle_ms=0, into=tidied)
            lengths = [
                await redis.xlen(s) for s in (keys.prompts, keys.generated, keys.scored, keys.dead)
            ]
            return tidied, lengths
        finally:
            await redis.aclose()

    tidied, lengths = asyncio.run(go())
    assert all(n < 300 for n in lengths), lengths  # approximate: whole nodes of 100 go
    assert tidied.entries == 4 * 300 - sum(lengths) and tidied.consumers == 4


def test_closing_goes_on_past_a_closer_that_hangs(caplog):
    """A stop must end: a closer that never returns is left behind after its time, named,
    and the ones after it still run."""
    from millstream.trainer.build import close_all

    ran: list[str] = []

    async def hangs() -> None:
        await asyncio.Event().wait()

    async def first() -> None:
        ran.append("first")

    asyncio.run(close_all([first, hangs], timeout_s=0.2))  # run last started first
    assert ran == ["first"]
    assert "closing test_closing_goes_on_past_a_closer_that_hangs.<locals>.hangs took more" in (
        caplog.text
    )
