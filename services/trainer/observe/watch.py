"""Nothing the trainer waits for waits silently.

`Watch.wait(what, awaitable)` runs one wait of the trainer (a batch from the buffer, an eval)
and, while it lasts, looks at who could still end it: the rollout and reward workers alive
by their heartbeat keys (`{run}:workers:{kind}:{name}`, which expire when a worker stops
beating) and the engines the router lists. Every `progress_every_s` it prints what it waits
for, for how long, and who is alive. When nothing can come any more, it fails with what to
do: no rollout worker, no reward worker or no engine for `stall_timeout_s` in a row.

It is also where a stop (SIGTERM, Ctrl-C: trainer/main.py) ends the trainer's loop cleanly.
`request_stop()` makes the next wait marked `abandon` (the batch wait that opens every
iteration) raise Stopped, and one under way raise it at once, unless what it waited for has
come: the buffer marks a batch trained when it hands it out, so a batch that came is trained,
never left half-way. So the loop stops between iterations, the step that has its batch
finishing first (train, sync, log, checkpoint), and nothing it counted is left in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import RedisError

from millstream.common.errors import MillstreamError
from millstream.common.keys import RunKeys

T = TypeVar("T")

PROGRESS_EVERY_S = 30.0

_WHAT_TO_DO = {
    "rollout": "start one: millstream rollout --redis-url URL --run-id {run}",
    "reward": "start one: millstream reward --redis-url URL --run-id {run}",
    "engine": "start an engine with --coordinator (the address in the [trainer] coordinator "
    "line) or register one with the router's /add_worker",
}


class Stalled(MillstreamError):
    """Nothing can end the trainer's wait: a kind of service has been gone too long."""


class Stopped(Exception):
    """A stop was asked for (`Watch.request_stop`): the trainer's loop ends between iterations."""


async def alive_workers(redis: Any, keys: RunKeys) -> dict[str, int]:
    """Live workers by kind, from their heartbeat keys."""
    pattern = _glob_escape(keys.heartbeat("", "")[: -len(":")]) + "*"
    counts = {"rollout": 0, "reward": 0}
    async for key in redis.scan_iter(match=pattern, count=100):
        kind = (key.decode() if isinstance(key, bytes) else key).split(":")[-2]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


class Watch:
    def __init__(
        self,
        redis: Any,
        keys: RunKeys,
        engines: Callable[[], Awaitable[list[str]]] | None,
        *,
        stall_timeout_s: float,
        progress_every_s: float = PROGRESS_EVERY_S,
        say: Callable[[str], None] = lambda line: print(f"[trainer] {line}", flush=True),
    ):
        self.redis = redis
        self.keys = keys
        self.engines = engines
        self.stall_timeout_s = stall_timeout_s
        self.progress_every_s = progress_every_s
        self.say = say
        self.check_every_s = min(progress_every_s, max(0.5, stall_timeout_s / 4))
        self._stop = asyncio.Event()
        self.looping = False  # a wait marked `abandon` began: the trainer's loop runs

    def request_stop(self) -> None:
        """End the trainer's loop at its next batch wait, or in the one under way (Stopped)."""
        self._stop.set()

    async def wait(
        self,
        what: str,
        awaitable: Awaitable[T],
        detail: Callable[[], str] = str,
        *,
        stall: bool = True,
        abandon: bool = False,
    ) -> T:
        """`awaitable`'s result; progress lines while it is long, Stalled when it cannot end
        (`stall=False`: progress only, for a wait that bounds itself, like a weight sync);
        `abandon`: Stopped, `awaitable` cancelled, once a stop is asked for before it ends."""
        if abandon:
            self.looping = True
            if self._stop.is_set():
                if inspect.iscoroutine(awaitable):
                    awaitable.close()  # never started: no "never awaited" warning
                raise Stopped(f"stopped before {what}")
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._stop.wait()) if abandon else None
        start = next_progress = time.monotonic()
        next_progress += self.progress_every_s
        kinds = ("rollout", "reward") + (("engine",) if self.engines is not None else ())
        last_seen = dict.fromkeys(kinds, start)
        try:
            while True:
                waits = {task} if stop is None else {task, stop}
                done, _ = await asyncio.wait(
                    waits, timeout=self.check_every_s, return_when=asyncio.FIRST_COMPLETED
                )
                if task in done:
                    return task.result()
                if stop in done:
                    raise Stopped(f"stopped while waiting for {what}")
                now = time.monotonic()
                alive = await self._alive()
                for kind, n in alive.items():
                    if n or n is None:  # None: could not tell (Redis restarting)
                        last_seen[kind] = now
                if now >= next_progress:
                    next_progress = now + self.progress_every_s
                    seen = ", ".join(f"{kind} {_count(n)}" for kind, n in alive.items())
                    extra = detail()
                    self.say(
                        f"waiting {now - start:.0f}s for {what}"
                        + (f" ({extra})" if extra else "") + f"; alive: {seen}"
                    )  # fmt: skip
                for kind, seen_at in last_seen.items():
                    if stall and now - seen_at >= self.stall_timeout_s:
                        raise Stalled(
                            f"waited {now - start:.0f}s for {what}, and no {kind} "
                            f"{'is routed' if kind == 'engine' else 'worker is alive'} for "
                            f"{now - seen_at:.0f}s (--stall-timeout {self.stall_timeout_s:g}): "
                            + _WHAT_TO_DO[kind].format(run=self.keys.run_id)
                        )
        finally:
            for pending in (task, stop):
                if pending is not None and not pending.done():
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)

    async def _alive(self) -> dict[str, int | None]:
        alive: dict[str, int | None] = {"rollout": None, "reward": None, "engine": None}
        with contextlib.suppress(RedisError, OSError):
            alive.update(await alive_workers(self.redis, self.keys))
        if self.engines is None:
            alive.pop("engine")
        else:
            with contextlib.suppress(Exception):  # the router restarting: no verdict this round
                alive["engine"] = len(await self.engines())
        return alive


def _count(n: int | None) -> str:
    return "?" if n is None else str(n)


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]\\" else c for c in text)
