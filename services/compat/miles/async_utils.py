"""Miles' `miles.utils.async_utils`: `run` a coroutine from sync code, on a background loop.

`run(coro)` blocks until the coroutine is done on one event loop that lives in a daemon thread
(made on first use), so sync plugin code may call async helpers (`post`, `async_rm`). It must
not be called from that loop itself (it would wait on itself), nor to share objects bound to
another loop. A sync plugin runs in a worker thread here, so calling `run` from it is safe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["AsyncioGatherUtils", "eager_create_task", "get_async_loop", "run"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class AsyncLoopThread:
    """One event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="miles-async-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_LOOP: AsyncLoopThread | None = None
_LOCK = threading.Lock()


def get_async_loop() -> AsyncLoopThread:
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = AsyncLoopThread()
    return _LOOP


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """The coroutine's result, run on the background loop (its exception, raised here)."""
    return get_async_loop().run(coro)


async def eager_create_task(coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
    """A task that has already started (one yield to the loop) when this returns."""
    task = asyncio.create_task(coro)
    await asyncio.sleep(0)
    return task


class AsyncioGatherUtils:
    """For `asyncio.gather(..., return_exceptions=True)` results."""

    @staticmethod
    def has_error(outputs: list[Any]) -> bool:
        return any(isinstance(output, BaseException) for output in outputs)

    @staticmethod
    def log_error(outputs: list[Any], debug_name: str) -> None:
        for i, output in enumerate(outputs):
            if isinstance(output, BaseException):
                log.warning("%s error index=%d", debug_name, i, exc_info=output)
