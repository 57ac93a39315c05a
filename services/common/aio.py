"""asyncio where Python 3.11's own pieces lose a cancellation, and ending tasks in bounded time.

`asyncio.wait_for` on Python 3.11 returns the awaited result when the cancel arrives in the
loop iteration in which that result lands (CPython gh-86296, fixed in 3.12 by building
wait_for on `asyncio.timeout`): the caller goes on as if never cancelled, and a `while True`
loop that was told to stop never does. redis-py wraps every write in it, so a task that was
cancelled while its Redis call finished kept running: the trainer's janitor outlived the run
it tidied and the trainer never exited (issue 42; tests/integration/test_cancel.py shows it
on a real redis-server). Millstream's code uses `wait_for` below (ruff bans the asyncio one:
pyproject.toml), and `redis_conn` writes to Redis without it.

`stop_tasks` cancels background tasks and waits a bounded time: a task that still runs is
named, with where it waits, and left behind, so a stop always ends. `run` is `asyncio.run`
with that bound on the tasks still running when the main coroutine ends (asyncio.run waits
for them forever).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`await awaitable`, TimeoutError after `timeout` seconds (None: no limit); a cancel is
    never lost (module docstring)."""
    async with asyncio.timeout(timeout):
        return await awaitable


def where(task: asyncio.Task) -> str:
    """`file:line in function` of the innermost frame `task` is suspended in ('' if none)."""
    frames = task.get_stack()
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


async def stop_tasks(
    tasks: Iterable[asyncio.Task | None], grace_s: float = STOP_GRACE_S, who: str = "millstream"
) -> list[str]:
    """Cancel `tasks` and wait up to `grace_s` for all of them together. Returns the names of
    those that did not end (each logged with where it waits), left running: whoever stops a
    process after this must not wait for them either (trainer/main.py)."""
    live = [t for t in tasks if t is not None and not t.done()]
    for task in live:
        task.cancel()
    if not live:
        return []
    done, pending = await asyncio.wait(live, timeout=grace_s)
    for task in done:  # retrieved: an error on the way out is not "never retrieved"
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s: the task %r ended with %r", who, task.get_name(), task.exception())
    for task in pending:
        log.error(
            "%s: the task %r did not end within %g s of its cancel (waiting at %s): left behind",
            who, task.get_name(), grace_s, where(task) or "?",
        )  # fmt: skip
    return sorted(t.get_name() for t in pending)


def run(
    main: Coroutine[Any, Any, T], grace_s: float = STOP_GRACE_S, who: str = "millstream"
) -> tuple[T, list[str]]:
    """`asyncio.run(main)` and the names of the tasks left behind (`stop_tasks` on what still
    runs when `main` ends). With none, the loop is closed as asyncio.run closes it; with some,
    it is left open (closing it would wait for them), and the caller should end the process
    without waiting for anything either (`os._exit` once its own files are written)."""
    runner = asyncio.Runner()
    left: list[str] = []
    try:
        return runner.run(main), left
    finally:
        loop = runner.get_loop()
        rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if rest:
            left += runner.run(stop_tasks(rest, grace_s, who))
        if not left:
            runner.close()
