"""Retries, one way for every service: tenacity with exponential backoff, jitter and a log line.

A `Backoff` states the policy: how many attempts (or for how long), the first and the longest
delay. `retrying` turns it into tenacity's `AsyncRetrying`, used as

    async for attempt in retrying(Backoff(attempts=5), "add_worker", retry_on=httpx.HTTPError):
        with attempt:
            await post(...)

Each attempt that fails with a `retry_on` error is logged ("add_worker: ConnectError ...;
retry 2/4 in 1.3 s") and tried again after the delay; any other error goes straight to the
caller, and after the last attempt the last error does (never tenacity's RetryError). A
`stop` event ends the retries early: a wait is cut short, the attempt after it is the last
(the caller may look at the event and not try), and its error is raised. A cancel is never
retried, whatever `retry_on` says.

The delays double from `first_s` up to `max_s`, each drawn between half and all of that (so
a fleet that failed together does not retry together). Who retries what:

| caller | on | policy |
|---|---|---|
| rollout/client.py `/generate` | a retryable GenerationFailed | 8 attempts, 0.5 s to 15 s |
| engine/http/registration.py add_worker, remove_worker | httpx errors but 401/403 | 10 / 3 attempts |
| engine/http/registration.py JoinEngine | gRPC errors but refusals | for 600 s, 0.5 s to 5 s |
| reward/scorer.py a reward attempt (remote RM included) | timeouts, errors but PluginFailed | --reward-retries |
| reward/celery_app.py send and collect a task | Redis and kombu connection errors | --redis-outage-timeout |

Redis commands ride out outages through `redis_conn.Outages` instead: its state is shared by
every caller of one client (one outage, one console line, one deadline), not kept per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception
from tenacity.stop import stop_after_attempt, stop_after_delay, stop_base, stop_never

from . import aio

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """`attempts` in all (None: no limit), or as many as fit in `within_s` seconds (None: no
    limit); each delay between half and all of `first_s * 2**(n-1)`, capped at `max_s`."""

    attempts: int | None = None
    within_s: float | None = None
    first_s: float = 0.5
    max_s: float = 15.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return min(self.max_s, self.first_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def stop(self) -> stop_base:
        stop: stop_base = stop_never
        if self.attempts is not None:
            stop = stop_after_attempt(self.attempts)
        if self.within_s is not None:
            stop = stop | stop_after_delay(self.within_s)
        return stop


def retrying(
    backoff: Backoff,
    what: str,
    *,
    retry_on: type[BaseException]
    | tuple[type[BaseException], ...]
    | Callable[[BaseException], bool],
    stop: asyncio.Event | None = None,
    logger: logging.Logger = log,
    level: int = logging.WARNING,
    every: int = 1,
) -> AsyncRetrying:
    """tenacity's AsyncRetrying for `backoff` (module docstring). `retry_on`: the errors worth
    another attempt, as classes or a predicate; `every`: log only the first retry and every
    `every`-th after it (a long wait for a service that is starting)."""
    classes = retry_on if isinstance(retry_on, type | tuple) else None

    def worth_retry(err: BaseException) -> bool:
        # tenacity's attempt catches BaseException: a cancel (or KeyboardInterrupt) must end
        # the retries whatever `retry_on` says, or a cancelled task would go on.
        if not isinstance(err, Exception):
            return False
        return isinstance(err, classes) if classes is not None else retry_on(err)

    def stopping(state: RetryCallState) -> bool:
        return stop is not None and stop.is_set()

    async def sleep(seconds: float) -> None:
        if stop is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            await aio.wait_for(stop.wait(), seconds)

    def say(state: RetryCallState) -> None:
        n = state.attempt_number
        if n != 1 and n % every:
            return
        err = state.outcome.exception() if state.outcome else None
        reason = f"{type(err).__name__}: {err}" if err is not None else "failed"
        of = f"/{backoff.attempts - 1}" if backoff.attempts else ""
        wait = state.next_action.sleep if state.next_action else 0.0
        logger.log(level, "%s: %s; retry %d%s in %.1f s", what, reason, n, of, wait)

    return AsyncRetrying(
        stop=backoff.stop() | stopping,
        wait=lambda state: backoff.delay(state.attempt_number),
        retry=retry_if_exception(worth_retry),
        sleep=sleep,
        before_sleep=say,
        reraise=True,
    )
