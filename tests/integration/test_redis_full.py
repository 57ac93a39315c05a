"""A full Redis (its maxmemory reached, maxmemory-policy noeviction) on a real redis-server:
writers wait for room instead of failing, hand-offs and acks still pass, trimming makes the
room, and nothing is lost or doubled (common/redis_conn.py, streams.py)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import OutOfMemoryError

from millstream.common import streams
from millstream.common.redis_conn import connect, not_waiting_for_room
from millstream.common.streams import Consumer
from millstream.common.types import PromptGroup
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ENTRY = 100_000  # bytes of one entry's prompt text
ENTRIES = 40  # 4 MB in all, twice the room Redis has


def group(i: int) -> PromptGroup:
    return PromptGroup(group_id=f"g{i}", data_index=i, prompt_text="x" * ENTRY)


def test_writers_wait_for_room_and_nothing_is_lost(tmp_path):
    server = RedisServer(tmp_path)
    said: list[str] = []

    async def go() -> tuple[list[str], list[str], int, int]:
        redis = await connect(server.url, who="test")
        redis.outages.say = said.append
        # Room for ~2 MB of entries above what this Redis uses empty.
        empty = (await redis.info("memory"))["used_memory"]
        await redis.config_set("maxmemory", empty + 2_000_000)
        assert (await redis.config_get("maxmemory-policy"))["maxmemory-policy"] == "noeviction"
        consumer = Consumer(
            redis, "in", "g", "c1", claim_idle_ms=60_000, max_deliveries=5,
            dead_stream="dead", block_ms=100,
        )  # fmt: skip
        await consumer.ensure_group()
        try:
            # Twice what fits, one entry at a time, as admission and workers publish.
            async def produce() -> None:
                for i in range(ENTRIES):
                    await streams.publish(redis, "in", group(i))

            producer = asyncio.create_task(produce())
            while redis.outages.fulls == 0:  # it met the bound and waits (does not fail)
                assert not producer.done(), producer
                await asyncio.sleep(0.05)
            assert await redis.xlen("in") < ENTRIES
            # A write that must not wait (a heartbeat) hears it at once. (The bound met by a
            # 100 kB XADD may leave room for a small SET: lowered below what is used for it.)
            used = (await redis.info("memory"))["used_memory"]
            await redis.config_set("maxmemory", used - 500_000)
            with pytest.raises(OutOfMemoryError), not_waiting_for_room():
                await redis.set("heartbeat", "1", ex=15)
            await redis.config_set("maxmemory", empty + 2_000_000)
            # The consumer drains it: every hand-off (ack first, then XADD) passes a full
            # Redis, and trimming below what the group still needs makes the room.
            handed: list[str] = []
            while len(handed) < ENTRIES:
                for entry in await consumer.read(8):
                    message = streams.decode(entry, PromptGroup)
                    out = PromptGroup(group_id=message.group_id)  # small: the text stays behind
                    assert await consumer.publish_and_ack("out", out, None, entry) is not None
                    handed.append(message.group_id)
                await streams.trim_safely(redis, "in", approximate=False)
            await asyncio.wait_for(producer, timeout=20)
            published = [
                PromptGroup.FromString(fields[b"data"]).group_id
                for _id, fields in await redis.xrange("out")
            ]
            pending = (await redis.xpending("in", "g"))["pending"]
            return handed, published, pending, redis.outages.fulls
        finally:
            await redis.aclose()

    try:
        handed, published, pending, fulls = asyncio.run(go())
    finally:
        server.stop()
    expected = [f"g{i}" for i in range(ENTRIES)]
    assert handed == expected and published == expected  # each once, in order
    assert pending == 0
    assert fulls >= 1
    assert any("is full" in line and "writes wait for room" in line for line in said), said
    assert any("room again after" in line for line in said), said
