"""A cancelled task stops: the trainer's janitor, which trims the run's streams in a loop on a
real redis-server, ends at its cancel wherever the cancel lands. On Python 3.11 redis-py's
writes (`asyncio.wait_for`) lost a cancel that arrived as a write ended, and the janitor went
on tidying after the run, so the trainer never exited (issue 42: the first of 200 cancels
already missed). Also: `aio.wait_for` keeps a cancel that lands with the result, and
`aio.stop_tasks` ends in bounded time, naming a task that will not stop."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest

from millstream.common import aio
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect
from millstream.trainer.janitor import Tidied, run_janitor

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_the_janitor_ends_at_every_cancel(redis_url):
    async def main() -> list[int]:
        redis = await connect(redis_url)
        keys = RunKeys("cancel")
        await redis.xadd(keys.scored, {"data": b"x"})
        await redis.xgroup_create(keys.scored, "trainer", id="0")
        rng, missed = random.Random(0), []
        try:
            for i in range(200):
                tidied = Tidied()
                janitor = asyncio.create_task(
                    run_janitor(redis, keys, interval_s=0, consumer_idle_ms=60_000, tidied=tidied)
                )
                await asyncio.sleep(rng.random() * 0.005)  # anywhere in a round
                janitor.cancel()
                done, _ = await asyncio.wait({janitor}, timeout=2.0)
                if not done:  # it goes on tidying: end it (another cancel lands) and say so
                    missed.append(i)
                    while not janitor.done():
                        janitor.cancel()
                        await asyncio.wait({janitor}, timeout=0.1)
                    break
            return missed
        finally:
            await redis.aclose()

    assert asyncio.run(main()) == []


def test_wait_for_keeps_a_cancel_that_lands_with_the_result():
    async def main() -> str:
        loop = asyncio.get_running_loop()
        result: asyncio.Future[int] = loop.create_future()

        async def waiter() -> str:
            await aio.wait_for(result, 5.0)
            return "went on as if never cancelled"

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the waiter awaits the result
        result.set_result(1)
        task.cancel()  # in the same loop iteration as the result
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(main()) == "cancelled"


def test_stop_tasks_names_a_task_that_ignores_its_cancel_and_returns(caplog):
    async def stubborn() -> None:
        cancels = 0
        while cancels < 2:  # the first cancel lost, as redis-py lost it; the test's second ends it
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                cancels += 1

    async def main() -> tuple[list[str], float]:
        quiet = asyncio.create_task(asyncio.sleep(60), name="quiet")
        loop_task = asyncio.create_task(stubborn(), name="janitor")
        await asyncio.sleep(0.05)  # both wait
        start = asyncio.get_running_loop().time()
        left = await aio.stop_tasks([quiet, None, loop_task], grace_s=0.3, who="trainer")
        took = asyncio.get_running_loop().time() - start
        assert quiet.cancelled()
        loop_task.cancel()
        await loop_task
        return left, took

    with caplog.at_level(logging.ERROR):
        left, took = asyncio.run(main())
    assert left == ["janitor"] and took < 5.0
    assert "the task 'janitor' did not end within 0.3 s of its cancel" in caplog.text
    assert "in stubborn" in caplog.text
