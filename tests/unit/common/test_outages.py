"""`redis_conn.Outages` without a server: calls that meet a lost connection are made again with
backoff until the outage has lasted the timeout; callers at the same time share one outage,
so the console hears one line when it starts and one when it ends."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from millstream.common.redis_conn import Outages

URL = "redis://:secret@127.0.0.1:6379/0"


class Flaky:
    """A Redis call that fails with `error` until `down_until` (monotonic), then answers."""

    def __init__(self, down_s: float, error: Exception):
        self.down_until = time.monotonic() + down_s
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if time.monotonic() < self.down_until:
            raise self.error
        return "OK"


def outages(timeout_s: float, lines: list[str]) -> Outages:
    return Outages(
        URL, timeout_s, "rollout-0", first_delay_s=0.01, max_delay_s=0.08, say=lines.append
    )


@pytest.mark.parametrize(
    "error",
    [RedisConnectionError("Connection refused"), RedisTimeoutError("Timeout reading"),
     BusyLoadingError("Redis is loading the dataset in memory"), ConnectionResetError(104, "reset")],
)  # fmt: skip
def test_a_call_rides_out_an_outage_and_says_so_twice(error: Exception):
    lines: list[str] = []
    o = outages(5.0, lines)
    flaky = Flaky(0.3, error)
    assert asyncio.run(o.call(flaky)) == "OK"
    assert o.reconnects == 1
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "[rollout-0] Redis at redis://:***@127.0.0.1:6379/0: connection lost"
    )
    assert lines[0].endswith("retrying for up to 5 s")
    assert lines[1].startswith(
        "[rollout-0] Redis at redis://:***@127.0.0.1:6379/0: reconnected after 0."
    )
    assert "secret" not in "".join(lines)
    # Backoff 0.01 doubling to 0.08: about 0.3 / 0.08 + 4 tries, not a busy loop.
    assert 4 <= flaky.calls <= 12, flaky.calls


def test_callers_at_the_same_time_share_one_outage():
    lines: list[str] = []
    o = outages(5.0, lines)
    flaky = Flaky(0.3, RedisConnectionError("Connection closed by server."))

    async def many() -> list[str]:
        return await asyncio.gather(*(o.call(flaky) for _ in range(20)))

    assert asyncio.run(many()) == ["OK"] * 20
    assert o.reconnects == 1
    assert [line.split(": ", 1)[1].split(" (")[0].split(" after")[0] for line in lines] == [
        "connection lost",
        "reconnected",
    ], lines


def test_an_outage_longer_than_the_timeout_raises_the_last_error():
    lines: list[str] = []
    o = outages(0.3, lines)
    flaky = Flaky(
        60, RedisConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
    )

    async def go() -> float:
        t0 = time.monotonic()
        with pytest.raises(RedisConnectionError, match="Connection refused"):
            await o.call(flaky)
        # Every later caller of the same outage gives up at once.
        t1 = time.monotonic()
        with pytest.raises(RedisConnectionError):
            await o.call(flaky)
        assert time.monotonic() - t1 < 0.05
        return t1 - t0

    assert 0.3 <= asyncio.run(go()) < 0.6
    assert o.reconnects == 0
    assert len(lines) == 2 and "giving up" in lines[1] and "--redis-outage-timeout 0.3" in lines[1]


def test_other_errors_are_not_an_outage():
    lines: list[str] = []
    o = outages(5.0, lines)
    flaky = Flaky(60, ResponseError("NOGROUP No such key"))
    with pytest.raises(ResponseError):
        asyncio.run(o.call(flaky))
    assert flaky.calls == 1 and lines == []


def test_a_call_that_started_before_the_outage_does_not_end_it():
    """A reply that was on its way when another call met the outage says nothing about now."""
    lines: list[str] = []
    o = outages(5.0, lines)

    async def go() -> None:
        slow_started = asyncio.Event()

        async def slow() -> str:
            slow_started.set()
            await asyncio.sleep(0.1)
            return "late reply"

        late = asyncio.create_task(o.call(slow))
        await slow_started.wait()
        down = asyncio.create_task(o.call(Flaky(0.4, RedisConnectionError("lost"))))
        assert await late == "late reply"
        assert o.reconnects == 0 and len(lines) == 1  # still lost
        assert await down == "OK"

    asyncio.run(go())
    assert o.reconnects == 1 and len(lines) == 2


def test_the_flag_defaults_to_120_s_and_must_be_positive(capsys):
    from millstream.common.config import parse_run_config

    base = ["--rollout-batch-size", "1"]
    assert parse_run_config(base).service.redis_outage_timeout == 120.0
    flag = ["--redis-outage-timeout", "2.5"]
    assert parse_run_config([*base, *flag]).service.redis_outage_timeout == 2.5
    with pytest.raises(SystemExit) as exited:
        parse_run_config([*base, "--redis-outage-timeout", "0"])
    assert exited.value.code == 2
    assert "--redis-outage-timeout must be > 0 (got 0.0)" in capsys.readouterr().err
