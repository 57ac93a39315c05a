"""The trainer's start: its own build runs beside the services' start, and the first failure
of either ends both at once (`launch.cluster.run_all`)."""

from __future__ import annotations

import asyncio

import pytest

from millstream.launch.cluster import run_all


def test_all_waits_finish():
    done: list[str] = []

    async def job(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        done.append(name)

    async def scenario() -> None:
        task = asyncio.create_task(job("task", 0.02))
        await run_all([job("coroutine", 0.01), task])

    asyncio.run(scenario())
    assert sorted(done) == ["coroutine", "task"]


def test_the_first_failure_cancels_the_rest_and_is_raised():
    cancelled = asyncio.Event()

    async def services_start() -> None:  # the engines loading their model: a long wait
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def build() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("--hf-checkpoint: cannot load")

    async def scenario() -> None:
        with pytest.raises(ValueError, match="cannot load"):
            await asyncio.wait_for(run_all([services_start(), build()]), 10)
        assert cancelled.is_set()

    asyncio.run(scenario())
