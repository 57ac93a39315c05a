"""Stream delivery against a real redis-server: takeover, exactly-once hand-off, dead letters,
trimming and the worker's drain. Sync tests drive asyncio with `asyncio.run`."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from millstream.common.errors import ServiceUnavailable
from millstream.common.keys import GROUP_REWARD, GROUP_ROLLOUT, RunKeys
from millstream.common.pb.messages_pb2 import PromptGroup, SampleGroup
from millstream.common.redis_conn import connect
from millstream.common.streams import (
    Consumer,
    StreamEntry,
    decode,
    delete_idle_consumers,
    publish,
    publish_many,
    trim_safely,
)
from millstream.common.worker import StreamWorker
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": ""}


@pytest.fixture
def keys() -> RunKeys:
    return RunKeys(f"t{uuid.uuid4().hex[:10]}")


def arun(main: Callable[[aioredis.Redis], Coroutine[Any, Any, Any]], url: str) -> Any:
    """Run `main(client)` in a fresh event loop with a connected client, closed afterwards."""

    async def wrapper() -> Any:
        client = await connect(url)
        try:
            return await main(client)
        finally:
            await client.aclose()

    return asyncio.run(wrapper())


def consumer(
    client: aioredis.Redis,
    keys: RunKeys,
    name: str,
    *,
    stream: str | None = None,
    group: str = GROUP_ROLLOUT,
    claim_idle_ms: int = 60_000,
    max_deliveries: int = 5,
    block_ms: int = 20,
) -> Consumer:
    return Consumer(
        client,
        stream or keys.prompts,
        group,
        name,
        claim_idle_ms=claim_idle_ms,
        max_deliveries=max_deliveries,
        dead_stream=keys.dead,
        block_ms=block_ms,
    )


def support_process(mode: str, url: str, stream: str, name: str, *args: str) -> subprocess.Popen:
    """tests/support/stream_consumer.py in its own process, in the rollout group."""
    command = [sys.executable, "-m", "tests.support.stream_consumer", mode, url, stream]
    return subprocess.Popen(
        [*command, GROUP_ROLLOUT, name, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def prompts(n: int) -> list[PromptGroup]:
    return [PromptGroup(group_id=f"g{i}", prompt_token_ids=[i, 2**31 - 1, 0]) for i in range(n)]


async def run_until(
    worker: StreamWorker, done: Callable[[], Awaitable[bool]], timeout_s: float = 10.0
) -> None:
    """Run the worker until `done()` holds, then stop it and wait for its drain."""
    task = asyncio.create_task(worker.run())
    deadline = time.monotonic() + timeout_s
    while not await done():
        if task.done():
            task.result()
            raise AssertionError("worker returned before it was stopped")
        if time.monotonic() > deadline:
            worker.stop()
            await task
            raise AssertionError(f"condition not reached within {timeout_s} s")
        await asyncio.sleep(0.02)
    worker.stop()
    await asyncio.wait_for(task, 10)


def handoff(c: Consumer, out_stream: str, deliveries: dict[str, int] | None = None):
    """A handler that turns a PromptGroup into a SampleGroup, handed off exactly once."""

    async def handler(entry: StreamEntry) -> None:
        prompt = decode(entry, PromptGroup)
        if deliveries is not None:
            deliveries[prompt.group_id] = entry.deliveries
        await c.publish_and_ack(out_stream, SampleGroup(prompt=prompt), entry.trace_fields, entry)

    return handler


async def pending_count(client: aioredis.Redis, stream: str, group: str) -> int:
    return int((await client.xpending(stream, group))["pending"])


async def outputs(client: aioredis.Redis, stream: str) -> list[tuple[SampleGroup, dict]]:
    return [
        (SampleGroup.FromString(fields[b"data"]), fields)
        for _id, fields in await client.xrange(stream)
    ]


@pytest.mark.timeout(60)
def test_killed_consumer_entries_are_taken_over_and_handed_off_exactly_once(redis_url, keys):
    async def publish_inputs(client: aioredis.Redis) -> None:
        await consumer(client, keys, "setup").ensure_group()
        await publish_many(client, keys.prompts, prompts(20), TRACE)

    arun(publish_inputs, redis_url)
    doomed = support_process("hang", redis_url, keys.prompts, "doomed", "--count", "8")
    try:
        assert doomed.stdout is not None
        assert doomed.stdout.readline().strip() == "READ 8"
    finally:
        doomed.kill()
        doomed.wait()
        doomed.stdout.close()

    async def take_over(client: aioredis.Redis) -> None:
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 8
        heir = consumer(client, keys, "heir", claim_idle_ms=200)
        deliveries: dict[str, int] = {}
        worker = StreamWorker(
            heir, handoff(heir, keys.generated, deliveries), concurrency=4, name="heir"
        )

        async def all_out() -> bool:
            return await client.xlen(keys.generated) >= 20

        await run_until(worker, all_out)
        out = await outputs(client, keys.generated)
        ids = [group.prompt.group_id for group, _fields in out]
        assert sorted(ids) == sorted(f"g{i}" for i in range(20)), "a duplicate or a missing one"
        assert all(fields[b"traceparent"] == TRACE["traceparent"].encode() for _, fields in out)
        # The 8 the killed consumer read came to the heir on their second delivery.
        assert sorted(deliveries.values()) == [1] * 12 + [2] * 8
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 0
        assert worker.processed == 20 and worker.failed == 0

    arun(take_over, redis_url)


def test_only_the_first_of_two_holders_hands_off(redis_url, keys):
    message = PromptGroup(
        group_id="only", prompt_token_ids=list(range(0, 300_000, 997)), prompt_text="é\x00ø"
    )

    async def body(client: aioredis.Redis) -> None:
        slow = consumer(client, keys, "slow")
        thief = consumer(client, keys, "thief", claim_idle_ms=50)
        await slow.ensure_group()
        await publish(client, keys.prompts, message)
        [held] = await slow.read(1)
        await asyncio.sleep(0.1)
        [stolen] = await thief.read(1)
        assert stolen.id == held.id and stolen.deliveries == 2
        first = await thief.publish_and_ack(
            keys.generated, SampleGroup(prompt=decode(stolen, PromptGroup)), None, stolen
        )
        late = await slow.publish_and_ack(
            keys.generated, SampleGroup(prompt=decode(held, PromptGroup)), None, held
        )
        assert first is not None and late is None
        [(out, fields)] = await outputs(client, keys.generated)
        assert out.prompt == message  # binary protobuf survived the Lua script
        assert fields[b"v"] == b"1"
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 0

    arun(body, redis_url)


def test_hand_offs_of_one_turn_go_in_one_pipeline_each_exactly_once(redis_url, keys):
    """200 jobs finishing together hand off in one round trip; an entry handed off twice in
    the same pipeline still yields one output; after Redis forgets the script (SCRIPT FLUSH,
    as after a restart) the next batch loads it again and loses nothing."""

    async def body(client: aioredis.Redis) -> None:
        c = consumer(client, keys, "batcher")
        await c.ensure_group()
        await publish_many(client, keys.prompts, prompts(200))
        entries = await c.read(200)
        assert len(entries) == 200

        async def hand_off(entry: StreamEntry) -> str | None:
            out = SampleGroup(prompt=decode(entry, PromptGroup))
            return await c.publish_and_ack(keys.generated, out, TRACE, entry)

        ids = await asyncio.gather(*(hand_off(e) for e in entries[:150]), hand_off(entries[0]))
        assert c._batch.batches == 1
        assert sum(i is not None for i in ids) == 150  # the second hand-off of entry 0: None
        await client.script_flush()
        rest = await asyncio.gather(*(hand_off(e) for e in entries[150:]))
        assert all(rest) and c._batch.batches == 2
        produced = await outputs(client, keys.generated)
        assert sorted(o.prompt.group_id for o, _ in produced) == sorted(f"g{i}" for i in range(200))
        assert all(f[b"traceparent"] == TRACE["traceparent"].encode() for _, f in produced)
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 0

    arun(body, redis_url)


def test_poison_entries_are_dead_lettered_and_good_ones_keep_flowing(redis_url, keys):
    good = PromptGroup(group_id="good").SerializeToString()
    poison = [
        ({"data": b"\xff\xff\xff", "v": "1"}, "is not a valid millstream.v1.PromptGroup"),
        ({"traceparent": "", "v": "1"}, "has no data field"),
        ({"data": good, "v": "99"}, "unknown schema version v='99'"),
    ]

    async def body(client: aioredis.Redis) -> None:
        c = consumer(client, keys, "w")
        await c.ensure_group()
        poison_ids = [await client.xadd(keys.prompts, fields) for fields, _ in poison]
        await publish_many(client, keys.prompts, prompts(5))
        worker = StreamWorker(c, handoff(c, keys.generated), concurrency=2, name="w")

        async def settled() -> bool:
            return await client.xlen(keys.generated) == 5 and await client.xlen(keys.dead) == 3

        await run_until(worker, settled)
        dead = {fields[b"source_id"]: fields for _id, fields in await client.xrange(keys.dead)}
        for entry_id, (fields, reason) in zip(poison_ids, poison, strict=True):
            letter = dead[entry_id]
            assert reason in letter[b"reason"].decode()
            assert letter[b"source_stream"] == keys.prompts.encode()
            assert letter[b"group"] == GROUP_ROLLOUT.encode()
            assert letter.get(b"data") == fields.get("data")  # the raw entry, intact
        assert (worker.processed, worker.poisoned, worker.dead_lettered) == (5, 3, 3)
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 0

    arun(body, redis_url)


@pytest.mark.timeout(30)
def test_an_entry_that_keeps_failing_is_dead_lettered_after_max_deliveries(redis_url, keys):
    calls: list[int] = []

    async def body(client: aioredis.Redis) -> None:
        c = consumer(client, keys, "w", claim_idle_ms=100, max_deliveries=2)
        await c.ensure_group()
        await publish(client, keys.prompts, PromptGroup(group_id="cursed"))

        async def failing(entry: StreamEntry) -> None:
            calls.append(entry.deliveries)
            raise RuntimeError("the handler broke")

        worker = StreamWorker(c, failing, concurrency=2, name="w")

        async def dead() -> bool:
            return await client.xlen(keys.dead) == 1

        await run_until(worker, dead)
        [(_id, letter)] = await client.xrange(keys.dead)
        assert b"more than --max-deliveries 2" in letter[b"reason"]
        assert letter[b"deliveries"] == b"3"
        assert calls == [1, 2] and worker.failed == 2 and worker.dead_lettered == 1
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 0

    arun(body, redis_url)


@pytest.mark.timeout(60)
def test_ten_thousand_entries_lose_none(redis_url, keys):
    n = 10_000
    seen: list[str] = []

    async def body(client: aioredis.Redis) -> None:
        c = consumer(client, keys, "w")
        await c.ensure_group()
        for start in range(0, n, 2000):
            batch = [PromptGroup(group_id=f"g{i}") for i in range(start, start + 2000)]
            await publish_many(client, keys.prompts, batch)

        async def count(entry: StreamEntry) -> None:
            seen.append(decode(entry, PromptGroup).group_id)

        worker = StreamWorker(c, count, concurrency=64, name="w", auto_ack=True)

        async def all_seen() -> bool:
            return len(seen) >= n

        await run_until(worker, all_seen, timeout_s=30)
        assert len(seen) == n and set(seen) == {f"g{i}" for i in range(n)}
        assert worker.processed == n
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 0

    arun(body, redis_url)


def test_trim_keeps_every_unacked_entry_and_removes_acked_ones(redis_url, keys):
    async def body(client: aioredis.Redis) -> None:
        assert await trim_safely(client, keys.prompts) == 0  # no stream yet
        await client.xadd(keys.prompts, {"v": "1"})
        assert await trim_safely(client, keys.prompts, approximate=False) == 0  # no group yet
        await client.delete(keys.prompts)

        fast = consumer(client, keys, "fast", group=GROUP_ROLLOUT)
        slow = consumer(client, keys, "slow", group=GROUP_REWARD)
        await fast.ensure_group()
        await slow.ensure_group()
        ids = await publish_many(client, keys.prompts, prompts(10))
        assert await trim_safely(client, keys.prompts, approximate=False) == 0  # none delivered
        for entry in await fast.read(10):
            await fast.ack(entry)
        held = await slow.read(5)
        for entry in (held[0], held[1], held[3]):
            await slow.ack(entry)

        async def left() -> list[str]:
            return [entry_id.decode() for entry_id, _ in await client.xrange(keys.prompts)]

        assert await trim_safely(client, keys.prompts, approximate=False) == 2
        assert await left() == ids[2:]  # ids[2] and ids[4] are still pending in `slow`
        for entry in (held[2], held[4]):
            await slow.ack(entry)
        assert await trim_safely(client, keys.prompts, approximate=False) == 2
        assert await left() == ids[4:]  # ids[5:] were never delivered to `slow`
        for entry in await slow.read(10):
            await slow.ack(entry)
        await trim_safely(client, keys.prompts, approximate=False)
        assert await left() == ids[9:]  # the last delivered entry is kept

    arun(body, redis_url)


def test_approximate_trim_removes_whole_nodes_below_the_oldest_pending(redis_url, keys):
    async def body(client: aioredis.Redis) -> None:
        c = consumer(client, keys, "w")
        await c.ensure_group()
        ids = await publish_many(client, keys.prompts, prompts(1000))
        entries = await c.read(1000)
        for entry in entries[:700]:
            await c.ack(entry)
        removed = await trim_safely(client, keys.prompts)
        remaining = {entry_id.decode() for entry_id, _ in await client.xrange(keys.prompts)}
        assert 0 < removed <= 700
        assert set(ids[700:]) <= remaining

    arun(body, redis_url)


@pytest.mark.timeout(60)
def test_sigterm_drains_in_flight_jobs_and_claims_no_more(redis_url, keys):
    async def publish_inputs(client: aioredis.Redis) -> list[str]:
        await consumer(client, keys, "setup").ensure_group()
        return await publish_many(client, keys.prompts, prompts(6))

    ids = arun(publish_inputs, redis_url)
    proc = support_process(
        "worker", redis_url, keys.prompts, "w", "--job-s", "2", "--concurrency", "2"
    )
    assert proc.stdout is not None
    try:
        started = [proc.stdout.readline().split()[1] for _ in range(2)]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == 0
    assert rest.splitlines() == ["STOPPED processed=2"], "a job started after SIGTERM"
    assert sorted(started) == ids[:2]

    async def check(client: aioredis.Redis) -> None:
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 0  # both acked
        after = await consumer(client, keys, "next").read(10)
        assert [entry.id for entry in after] == ids[2:]  # never claimed by the stopped one

    arun(check, redis_url)


@pytest.mark.timeout(30)
def test_stop_cuts_a_blocking_read_short(redis_url, keys):
    """An idle worker blocks in XREADGROUP for --stream-block-ms; stop() must not wait it out
    (it did: a second per worker, and per trainer, at every shutdown)."""

    async def body(client: aioredis.Redis) -> None:
        c = consumer(client, keys, "w", block_ms=4_000)  # within the client's socket timeout
        await c.ensure_group()

        async def never(entry: StreamEntry) -> None:
            raise AssertionError("nothing was published")

        worker = StreamWorker(c, never, concurrency=1, name="w")
        task = asyncio.create_task(worker.run())
        # Until Redis shows a connection blocked in XREADGROUP: the read is under way.
        while not any(c.get("cmd") == "xreadgroup" for c in await client.client_list()):
            assert not task.done(), task  # (a failed run() would leave this loop waiting)
            await asyncio.sleep(0.01)
        worker.stop()
        await asyncio.wait_for(task, 2)  # well before the 4 s block ends
        # The stream still works for the next consumer: nothing was left half-read.
        await publish(client, keys.prompts, PromptGroup(group_id="after"))
        after = await consumer(client, keys, "next").read(10)
        assert [decode(e, PromptGroup).group_id for e in after] == ["after"]

    arun(body, redis_url)


@pytest.mark.timeout(30)
def test_drain_is_bounded_and_leaves_a_stuck_entry_pending(redis_url, keys):
    async def body(client: aioredis.Redis) -> None:
        c = consumer(client, keys, "w")
        await c.ensure_group()
        await publish(client, keys.prompts, PromptGroup(group_id="stuck"))
        started = asyncio.Event()

        async def stuck(entry: StreamEntry) -> None:
            started.set()
            await asyncio.Event().wait()

        beat_key = keys.heartbeat("rollout", "w")
        worker = StreamWorker(
            c, stuck, concurrency=1, name="w", heartbeat=(client, beat_key, 5), drain_timeout_s=0.3
        )
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(started.wait(), 5)
        while not await client.exists(beat_key):  # the first beat races the first job
            await asyncio.sleep(0.01)
        assert json.loads(await client.get(beat_key))["name"] == "w"
        worker.stop()
        await asyncio.wait_for(task, 3)
        assert worker.processed == 0 and worker.failed == 0
        assert await pending_count(client, keys.prompts, GROUP_ROLLOUT) == 1
        assert await client.exists(beat_key) == 0

    arun(body, redis_url)


def test_a_live_long_job_keeps_its_lease(redis_url, keys):
    async def body(client: aioredis.Redis) -> None:
        owner = consumer(client, keys, "owner", claim_idle_ms=300)
        thief = consumer(client, keys, "thief", claim_idle_ms=300)
        await owner.ensure_group()
        await publish(client, keys.prompts, PromptGroup(group_id="long"))
        stolen: list[StreamEntry] = []

        async def long_job(entry: StreamEntry) -> None:
            for _ in range(10):  # 1.5 s, five times claim_idle_ms
                await asyncio.sleep(0.15)
                stolen.extend(await thief.read(1))
            await handoff(owner, keys.generated)(entry)

        worker = StreamWorker(owner, long_job, concurrency=1, name="owner")

        async def handed_off() -> bool:
            return await client.xlen(keys.generated) == 1

        await run_until(worker, handed_off)
        assert stolen == [] and worker.processed == 1

    arun(body, redis_url)


def test_consumer_refuses_a_decoding_client(redis_url, keys):
    async def body(client: aioredis.Redis) -> None:
        text_client = aioredis.from_url(redis_url, decode_responses=True)
        try:
            with pytest.raises(ValueError, match="decode_responses=False"):
                consumer(text_client, keys, "w")
        finally:
            await text_client.aclose()

    arun(body, redis_url)


def test_unreachable_redis_names_the_url():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(ServiceUnavailable, match=re.escape(url)):
        asyncio.run(connect(url, timeout_s=2))


def test_departed_consumers_are_deleted_only_without_pending_entries(redis_url, keys):
    async def body(client: aioredis.Redis) -> None:
        assert await delete_idle_consumers(client, keys.prompts, 0) == 0  # no stream yet
        gone, holding, live = (consumer(client, keys, n) for n in ("gone", "holding", "live"))
        await gone.ensure_group()
        await publish_many(client, keys.prompts, prompts(3))
        for entry in await gone.read(1):
            await gone.ack(entry)
        held = await holding.read(1)
        await asyncio.sleep(0.3)
        await live.read(1)  # just read: not idle
        deleted = await delete_idle_consumers(client, keys.prompts, 200)
        names = {c["name"].decode() for c in await client.xinfo_consumers(keys.prompts, "rollout")}
        assert deleted == 1 and names == {"holding", "live"}
        pending = await client.xpending(keys.prompts, "rollout")
        assert pending["pending"] == 2  # what `holding` and `live` own is still owned
        await holding.ack(held[0])
        assert await delete_idle_consumers(client, keys.prompts, 200) == 1  # now `holding` goes

    arun(body, redis_url)
