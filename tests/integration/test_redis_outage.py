"""Redis outages against a real redis-server (AOF on): stopped (SIGSTOP: every call times out)
or restarted on the same port (SIGTERM, a few seconds away), while a stream worker reads, a
producer adds and the trainer's buffer takes scored groups. After Redis returns every entry
is processed exactly once and acked, in-flight jobs hand off, and each client says "connection
lost" and "reconnected" once; an outage longer than --redis-outage-timeout ends with the old
error."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from millstream.common.keys import RunKeys
from millstream.common.redis_conn import Client, connect
from millstream.common.streams import Consumer, StreamEntry, decode, publish
from millstream.common.types import PromptGroup, Sample, SampleGroup, ScoredGroup, Verdict
from millstream.common.worker import RedisGone, StreamWorker
from millstream.trainer.buffer import Buffer
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

STREAM = "outage:in"
GROUP = "g"


@pytest.fixture
def server(tmp_path: Path):
    s = RedisServer(tmp_path, appendonly=True)
    yield s
    if s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGCONT)  # a test that failed while Redis was stopped
    s.stop()


async def client(url: str, who: str, lines: list[str], timeout_s: float = 30.0) -> Client:
    redis = await connect(url, outage_timeout_s=timeout_s, who=who)
    redis.outages.say = lines.append
    return redis


def consumer(redis: aioredis.Redis, name: str = "c1") -> Consumer:
    return Consumer(
        redis, STREAM, GROUP, name, claim_idle_ms=60_000, max_deliveries=5,
        dead_stream="outage:dead", block_ms=100,
    )  # fmt: skip


def said(lines: list[str], what: str) -> list[str]:
    return [line for line in lines if what in line]


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def pending(redis: aioredis.Redis, stream: str = STREAM, group: str = GROUP) -> int:
    return (await redis.xpending(stream, group))["pending"]


async def none_pending(redis: aioredis.Redis, stream: str = STREAM, group: str = GROUP) -> bool:
    return await pending(redis, stream, group) == 0


async def stream_ids(redis: aioredis.Redis, stream: str = STREAM) -> list[str]:
    return [entry_id.decode() for entry_id, _ in await redis.xrange(stream)]


def test_a_consumer_takes_back_its_own_entries_whose_reply_was_lost(redis_url):
    """What a read whose reply died with the connection leaves behind: entries pending under
    this consumer that no job of it holds. After a reconnect its next read returns them,
    counting one more delivery, and leaves the ones its live jobs hold alone (uncounted)."""

    async def go() -> None:
        redis = await connect(redis_url)
        try:
            c = consumer(redis)
            await c.ensure_group()
            ids = [await publish(redis, STREAM, PromptGroup(group_id=f"g{i}")) for i in range(5)]
            assert [e.id for e in await c.read(2)] == ids[:2]  # running: "held"
            # The lost reply: delivered to c1 by Redis, never seen by c1.
            await redis.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=3)
            assert await c.read(5) == []  # no reconnect yet: nothing to take back
            redis.outages.reconnects += 1  # as after an outage
            back = await c.read(2, held=ids[:2])
            assert [(e.id, e.deliveries) for e in back] == [(ids[2], 2), (ids[3], 2)]
            back = await c.read(5, held=[*ids[:2], *ids[2:4]])
            assert [(e.id, e.deliveries) for e in back] == [(ids[4], 2)]
            rows = await redis.xpending_range(STREAM, GROUP, "-", "+", 10)
            assert [r["times_delivered"] for r in rows] == [1, 1, 2, 2, 2]  # held: not counted
            assert await c.read(5) == []  # the walk is over: only new entries from here
        finally:
            await redis.aclose()

    asyncio.run(go())


class LostReplies:
    """A TCP proxy in front of Redis that, while `dropping`, forwards every command but drops
    every reply: the network failing one way, so Redis runs what it was sent (a blocking read
    delivers entries into the consumer's pending list) and the client hears nothing. When it
    stops dropping, the connections that lost a reply are closed (they could not be in step
    with Redis again); new ones work."""

    def __init__(self, redis_port: int):
        self.redis_port = redis_port
        self.dropping = False
        self._broken: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    def drop(self, on: bool) -> None:
        self.dropping = on
        if not on:
            for writer in self._broken:
                writer.close()
            self._broken.clear()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _connection(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter):
        r_reader, r_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, replies: bool):
            while data := await src.read(65536):
                if replies and self.dropping:
                    self._broken.add(c_writer)
                    continue
                dst.write(data)
            dst.close()

        await asyncio.gather(
            pump(c_reader, r_writer, False), pump(r_reader, c_writer, True),
            return_exceptions=True,
        )  # fmt: skip


def test_entries_whose_delivery_reply_was_lost_are_taken_back_and_run_once(server: RedisServer):
    """Replies lost for 6 s (the socket timeout is 5): the read that was waiting when they
    started delivers what the producer adds then into the worker's pending list, unseen by
    it; after the reconnect the worker takes those back (their second delivery) and runs
    every entry once."""
    n = 40

    async def go() -> dict:
        proxy = LostReplies(server.port)
        lines: list[str] = []
        w_redis = await client(await proxy.start(), "worker", lines)
        p_redis = await connect(server.url)  # beside the proxy: it keeps adding
        runs: Counter[str] = Counter()
        deliveries: dict[str, int] = {}

        async def handler(entry: StreamEntry) -> None:
            runs[entry.id] += 1
            deliveries[entry.id] = entry.deliveries

        c = Consumer(
            w_redis, STREAM, GROUP, "c1", claim_idle_ms=60_000, max_deliveries=5,
            dead_stream="outage:dead", block_ms=1000,
        )  # fmt: skip
        worker = StreamWorker(c, handler, concurrency=4, name="w", auto_ack=True)
        try:
            await c.ensure_group()
            running = asyncio.create_task(worker.run())
            for i in range(n // 2):
                await publish(p_redis, STREAM, PromptGroup(group_id=f"g{i}"))
            await wait_until(lambda: none_pending(p_redis), 10, "the first half")
            await asyncio.sleep(0.3)  # the worker waits in a blocking read
            proxy.drop(True)
            for i in range(n // 2, n):
                await publish(p_redis, STREAM, PromptGroup(group_id=f"g{i}"))
            await asyncio.sleep(6.0)
            proxy.drop(False)
            await wait_until(lambda: none_pending(p_redis), 20, "every entry acked")
            worker.stop()
            await running
            return {"runs": runs, "deliveries": deliveries, "ids": await stream_ids(p_redis),
                    "lines": lines}  # fmt: skip
        finally:
            await w_redis.aclose()
            await p_redis.aclose()
            await proxy.close()

    r = asyncio.run(go())
    assert len(r["ids"]) == n and set(r["runs"]) == set(r["ids"]), r["runs"]
    assert set(r["runs"].values()) == {1}
    taken_back = [i for i, d in r["deliveries"].items() if d == 2]
    assert taken_back, r["deliveries"]  # the lost read's entries, run on their second delivery
    assert len(said(r["lines"], "connection lost")) == 1, r["lines"]
    assert len(said(r["lines"], "reconnected after")) == 1, r["lines"]


def run_worker_through(server: RedisServer, outage: Callable[[], None], n: int) -> dict:
    """A StreamWorker (4 jobs of 0.2 s at once, auto-ack) reads what a producer adds, one
    entry every 20 ms, from two clients of their own; `outage()` runs (in a thread) a second
    after both started. Returns what they processed and said."""

    async def go() -> dict:
        lines: dict[str, list[str]] = {"worker": [], "producer": []}
        w_redis = await client(server.url, "worker", lines["worker"])
        p_redis = await client(server.url, "producer", lines["producer"])
        done: Counter[str] = Counter()
        payloads: Counter[str] = Counter()

        async def handler(entry: StreamEntry) -> None:
            await asyncio.sleep(0.2)  # jobs in flight when Redis goes
            done[entry.id] += 1
            payloads[decode(entry, PromptGroup).group_id] += 1

        worker = StreamWorker(consumer(w_redis), handler, concurrency=4, name="w", auto_ack=True)
        try:
            await worker.consumer.ensure_group()
            running = asyncio.create_task(worker.run())

            async def produce() -> None:
                for i in range(n):
                    await publish(p_redis, STREAM, PromptGroup(group_id=f"g{i}"))
                    await asyncio.sleep(0.02)

            producing = asyncio.create_task(produce())
            await asyncio.sleep(1.0)
            await asyncio.to_thread(outage)
            await asyncio.wait_for(producing, 30)
            await wait_until(lambda: _all_done(w_redis, payloads, n), 30, "every entry")
            worker.stop()
            await running
            return {
                "done": done, "payloads": payloads, "ids": await stream_ids(w_redis),
                "pending": await pending(w_redis), "lines": lines, "processed": worker.processed,
            }  # fmt: skip
        finally:
            await w_redis.aclose()
            await p_redis.aclose()

    return asyncio.run(go())


async def _all_done(redis: aioredis.Redis, payloads: Counter[str], n: int) -> bool:
    return len(payloads) == n and await none_pending(redis)


def check_exactly_once(r: dict, n: int) -> None:
    # Every entry of the stream processed once and acked; every message published is there
    # (a producer's XADD repeated after its reply was lost would add a second entry for the
    # same message: each entry still runs once, and group ids dedupe downstream).
    assert set(r["done"]) == set(r["ids"]) and set(r["done"].values()) == {1}, r["done"]
    assert set(r["payloads"]) == {f"g{i}" for i in range(n)}
    assert r["processed"] == len(r["ids"]) and r["pending"] == 0
    for who, lines in r["lines"].items():
        assert len(said(lines, "connection lost")) == 1, (who, lines)
        assert len(said(lines, "reconnected after")) == 1, (who, lines)


def test_a_worker_and_a_producer_ride_out_a_redis_restart(server: RedisServer):
    r = run_worker_through(server, lambda: server.restart(down_s=3.0), n=100)
    check_exactly_once(r, 100)
    (line,) = said(r["lines"]["worker"], "reconnected after")
    assert 2.5 < float(line.rsplit("after ", 1)[1].split(" s")[0]) < 6


def test_a_worker_and_a_producer_ride_out_a_stopped_redis(server: RedisServer):
    """SIGSTOP: calls time out after the 5 s socket timeout, and what was sent on the dead
    connections still runs when Redis wakes (a producer's XADD may then land twice: each
    entry still runs once). Lost read replies: the test below."""

    def stop_for(seconds: float) -> None:
        os.kill(server.proc.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(server.proc.pid, signal.SIGCONT)

    r = run_worker_through(server, lambda: stop_for(7.0), n=100)
    check_exactly_once(r, 100)


def test_the_buffer_takes_every_scored_group_once_across_a_restart(server: RedisServer):
    keys = RunKeys("outage")
    n = 60

    def scored(gid: str) -> ScoredGroup:
        sample = Sample(group_id=gid, response_token_ids=[1], weight_versions=[0])
        group = SampleGroup(prompt=PromptGroup(group_id=gid), samples=[sample])
        return ScoredGroup(group=group, verdict=Verdict.VERDICT_KEPT)

    async def go() -> tuple[list[str], int, int, list[str]]:
        lines: list[str] = []
        redis = await client(server.url, "trainer", lines)
        producer = await client(server.url, "reward-0", [])
        buffer = Buffer(
            redis, keys, "trainer-test", claim_idle_ms=60_000, max_deliveries=3, block_ms=100,
            on_terminal=lambda gid, state: None, expected=lambda gid: True,
        )  # fmt: skip
        await buffer.start()
        try:

            async def produce() -> None:
                for i in range(n):
                    await publish(producer, keys.scored, scored(f"g{i}"))
                    await asyncio.sleep(0.03)

            producing = asyncio.create_task(produce())
            taking = asyncio.create_task(buffer.take(n, version=0, max_lag=None))
            await asyncio.sleep(0.7)
            await asyncio.to_thread(server.restart, 3.0)
            await asyncio.wait_for(producing, 30)
            batch = await asyncio.wait_for(taking, 30)
            await wait_until(lambda: none_pending(redis, keys.scored, "trainer"), 10, "acks")
            return (
                [g.group.prompt.group_id for g in batch], buffer.duplicates,
                await pending(redis, keys.scored, "trainer"), lines,
            )  # fmt: skip
        finally:
            await buffer.stop()
            await redis.aclose()
            await producer.aclose()

    taken, duplicates, left, lines = asyncio.run(go())
    assert Counter(taken) == Counter(f"g{i}" for i in range(n))  # each once, none lost
    assert left == 0
    assert duplicates <= 1  # only a producer's XADD repeated after a lost reply
    assert len(said(lines, "connection lost")) == 1 and len(said(lines, "reconnected")) == 1


def test_an_outage_longer_than_the_timeout_ends_the_worker_with_the_old_error(server: RedisServer):
    async def go() -> tuple[float, str, list[str]]:
        lines: list[str] = []
        redis = await client(server.url, "rollout-0", lines, timeout_s=2.0)

        async def handler(entry: StreamEntry) -> None:
            await asyncio.sleep(0.05)

        worker = StreamWorker(consumer(redis), handler, concurrency=2, name="w", auto_ack=True)
        try:
            running = asyncio.create_task(worker.run())
            await asyncio.sleep(0.5)
            await asyncio.to_thread(server.proc.terminate)
            t0 = time.monotonic()
            with pytest.raises(RedisGone) as gone:
                await asyncio.wait_for(running, 20)
            return time.monotonic() - t0, str(gone.value), lines
        finally:
            await redis.aclose()

    took_s, error, lines = asyncio.run(go())
    assert 2.0 <= took_s < 5.0, took_s
    assert f"Redis at redis://127.0.0.1:{server.port}/0 is unreachable" in error
    assert "--redis-outage-timeout" in error
    assert len(said(lines, "connection lost")) == 1 and len(said(lines, "giving up")) == 1
    assert said(lines, "reconnected") == []
