"""common/retry.py: the one retry policy every service uses (tenacity underneath)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from millstream.common.retry import Backoff, retrying


async def _run(backoff: Backoff, fail_times: int, exc: type[BaseException] = ValueError, **kw):
    calls = 0
    async for attempt in retrying(backoff, "thing", retry_on=kw.pop("retry_on", ValueError), **kw):
        with attempt:
            calls += 1
            if calls <= fail_times:
                raise exc(f"failure {calls}")
    return calls


def test_retries_until_success_and_logs_each_retry(caplog):
    caplog.set_level(logging.WARNING, logger="millstream.common.retry")
    assert asyncio.run(_run(Backoff(attempts=4, first_s=0.001), fail_times=2)) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0].startswith("thing: ValueError: failure 1; retry 1/3 in ")


def test_the_last_error_is_raised_after_the_last_attempt():
    with pytest.raises(ValueError, match="failure 3"):
        asyncio.run(_run(Backoff(attempts=3, first_s=0.001), fail_times=5))


def test_an_error_not_retried_goes_straight_to_the_caller():
    started = time.monotonic()
    with pytest.raises(KeyError):
        asyncio.run(_run(Backoff(attempts=5, first_s=1.0), fail_times=5, exc=KeyError))
    assert time.monotonic() - started < 0.5


def test_a_predicate_picks_what_is_retried():
    calls = asyncio.run(
        _run(
            Backoff(attempts=5, first_s=0.001),
            fail_times=1,
            exc=OSError,
            retry_on=lambda err: isinstance(err, OSError) and "failure" in str(err),
        )
    )
    assert calls == 2


def test_within_s_bounds_the_retries_in_time():
    started = time.monotonic()
    with pytest.raises(ValueError):
        asyncio.run(_run(Backoff(within_s=0.3, first_s=0.05, max_s=0.05), fail_times=10**6))
    assert 0.3 <= time.monotonic() - started < 1.5


def test_delays_double_with_jitter_up_to_the_cap():
    backoff = Backoff(first_s=0.5, max_s=15.0)
    for attempt, full in [(1, 0.5), (2, 1.0), (4, 4.0), (6, 15.0), (9, 15.0)]:
        delays = [backoff.delay(attempt) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in delays)
        assert max(delays) - min(delays) > full / 10  # jittered, not one value


def test_a_stop_event_cuts_the_wait_short_and_makes_the_next_attempt_the_last():
    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        started = time.monotonic()
        with pytest.raises(ValueError, match="failure 2"):
            await _run(Backoff(first_s=30.0), fail_times=10, stop=stop)
        return time.monotonic() - started

    assert asyncio.run(main()) < 2.0


def test_a_cancel_is_never_retried_even_when_the_predicate_says_yes():
    # tenacity's attempt catches BaseException; a predicate that retries "everything" must not
    # turn a cancel into another attempt (the scorer retries every non-plugin error).
    attempts = 0

    async def body():
        nonlocal attempts
        async for attempt in retrying(
            Backoff(attempts=50, first_s=0.001), "cancelled", retry_on=lambda err: True
        ):
            with attempt:
                attempts += 1
                await asyncio.sleep(10)

    async def main():
        task = asyncio.create_task(body())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)

    asyncio.run(main())
    assert attempts == 1
