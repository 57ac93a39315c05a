"""The trainer's buffer on a real stream: one terminal state per group id, duplicates ignored
(also ids consumed before a restart), staleness drops, eval groups routed to their waiter."""

from __future__ import annotations

import asyncio

import pytest

from millstream.common import streams
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect
from millstream.common.types import PromptGroup, Sample, SampleGroup, ScoredGroup, Verdict
from millstream.trainer.buffer import Buffer, group_lag

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def scored(
    gid: str, verdict: int = Verdict.VERDICT_KEPT, versions=(3, 3), is_eval: bool = False
) -> ScoredGroup:
    sample = Sample(
        group_id=gid, response_token_ids=[1] * len(versions), weight_versions=list(versions)
    )
    prompt = PromptGroup(group_id=gid, is_eval=is_eval)
    return ScoredGroup(group=SampleGroup(prompt=prompt, samples=[sample]), verdict=verdict)


def make_buffer(redis, keys: RunKeys, on_terminal=lambda gid, state: None,
                expected=lambda gid: True) -> Buffer:  # fmt: skip
    """The trainer's buffer on `keys`, with the settings every test here uses."""
    return Buffer(
        redis, keys, "trainer-test", claim_idle_ms=60_000, max_deliveries=3, block_ms=200,
        on_terminal=on_terminal, expected=expected,
    )  # fmt: skip


def test_group_lag_is_measured_from_the_oldest_token():
    assert group_lag(scored("g", versions=(2, 5)), version=6) == 4
    assert group_lag(scored("g", versions=()), version=6) == 0


def test_buffer_accounts_every_group_once(redis_url):
    keys = RunKeys("buf")
    ended: list[tuple[str, str]] = []

    async def go() -> tuple[list[str], list[str], int]:
        redis = await connect(redis_url)
        buffer = make_buffer(
            redis, keys, on_terminal=lambda gid, state: ended.append((gid, state)),
            expected=lambda gid: gid != "old" and gid not in {g for g, _ in ended},
        )  # fmt: skip
        await buffer.start()
        try:
            messages = [
                scored("a"), scored("b", Verdict.VERDICT_FILTERED), scored("c", Verdict.VERDICT_FAILED),
                scored("stale", versions=(0, 1)), scored("a"), scored("old"), scored("d"),
                scored("e1", is_eval=True), scored("e2", is_eval=True),
            ]  # fmt: skip
            await streams.publish_many(redis, keys.scored, messages)
            batch = await asyncio.wait_for(buffer.take(2, version=3, max_lag=2), timeout=20)
            evals = await asyncio.wait_for(buffer.wait_eval(["e2", "e1"]), timeout=20)
            return (
                [g.group.prompt.group_id for g in batch],
                [g.group.prompt.group_id for g in evals],
                buffer.duplicates,
            )
        finally:
            await buffer.stop()
            await redis.aclose()

    batch, evals, duplicates = asyncio.run(go())
    assert batch == ["a", "d"]
    assert evals == ["e2", "e1"]
    assert duplicates == 2  # the second "a", and "old", which this run does not expect
    assert sorted(ended) == sorted(
        [
            ("a", "trained"),
            ("d", "trained"),
            ("b", "filtered"),
            ("c", "failed"),
            ("stale", "dropped_stale"),
        ]
    )


def test_a_burst_lands_in_arrival_order_and_every_entry_is_acked(redis_url):
    """600 groups published at once (more than one read's worth): taken in the order they
    were published, eval groups among them routed to their waiter, nothing left pending."""
    keys = RunKeys("burst")

    async def go() -> tuple[list[str], int]:
        redis = await connect(redis_url)
        buffer = make_buffer(redis, keys)
        await buffer.start()
        try:
            messages = [scored(f"g{i:03d}", is_eval=i % 3 == 0) for i in range(600)]
            await streams.publish_many(redis, keys.scored, messages)
            evals = [f"g{i:03d}" for i in range(0, 600, 3)]
            await asyncio.wait_for(buffer.wait_eval(evals), timeout=20)
            batch = await asyncio.wait_for(buffer.take(400, version=3, max_lag=None), 20)
            await asyncio.sleep(0.1)  # the last acks of the turn
            pending = (await redis.xpending(keys.scored, "trainer"))["pending"]
            return [g.group.prompt.group_id for g in batch], int(pending)
        finally:
            await buffer.stop()
            await redis.aclose()

    taken, pending = asyncio.run(go())
    assert taken == [f"g{i:03d}" for i in range(600) if i % 3] and pending == 0


def test_dead_letters_end_their_groups_failed(redis_url):
    """Entries dead-lettered from any stream end their group `failed` with the reason, once;
    bad bytes and groups this run does not wait for are counted, never terminal."""
    keys = RunKeys("dead")
    ended: list[tuple[str, str]] = []
    admitted = {"p1", "g1", "s1"}

    async def go() -> tuple[Buffer, list[ScoredGroup]]:
        redis = await connect(redis_url)
        buffer = make_buffer(
            redis, keys,
            on_terminal=lambda gid, state: (ended.append((gid, state)), admitted.discard(gid)),
            expected=admitted.__contains__,
        )  # fmt: skip
        await buffer.start()
        try:
            sources = [
                (keys.prompts, PromptGroup(group_id="p1")),
                (keys.generated, SampleGroup(prompt=PromptGroup(group_id="g1"))),
                (keys.scored, scored("s1")),
                (keys.prompts, PromptGroup(group_id="p1")),  # a second dead copy: ignored
                (keys.prompts, PromptGroup(group_id="stranger")),
                (keys.prompts, PromptGroup(group_id="ev", is_eval=True)),
            ]
            for stream, message in sources:
                await redis.xadd(
                    keys.dead,
                    {**streams.entry_fields(message), "source_stream": stream, "reason": "boom"},
                )
            await redis.xadd(keys.dead, {"data": b"\xff\x00", "source_stream": keys.prompts})
            await redis.xadd(keys.dead, {"source_stream": keys.generated, "reason": "no data"})
            evals = await asyncio.wait_for(buffer.wait_eval(["ev"]), timeout=20)
            for _ in range(100):
                if buffer.dead_letters + buffer.dead_foreign == 7:
                    break
                await asyncio.sleep(0.1)
            return buffer, evals
        finally:
            await buffer.stop()
            await redis.aclose()

    buffer, evals = asyncio.run(go())
    assert sorted(ended) == [("g1", "failed"), ("p1", "failed"), ("s1", "failed")]
    assert (buffer.dead_letters, buffer.dead_foreign) == (3, 4)
    assert evals[0].verdict == Verdict.VERDICT_FAILED and evals[0].reason == "boom"


class Rows:
    """A prompt source of numbered rows (Admission's interface of trainer/data.py)."""

    def __init__(self) -> None:
        self.taken = 0

    def take(self, k: int) -> list:
        from millstream.trainer.data import PromptRow

        rows = [PromptRow(self.taken + i, "1+1=", [1, 2], "2", {}) for i in range(k)]
        self.taken += k
        return [(row, 0) for row in rows]

    def release(self, data_index: int) -> None:
        pass


def test_a_fill_cancelled_mid_publish_still_publishes_and_counts_its_groups(redis_url):
    """The run's end cancels the admission pump wherever it is: a group it was publishing
    must land and be counted, or admitted != terminal states (seen in an e2e run)."""
    from millstream.trainer.admission import Admission

    stream = RunKeys("adm").prompts

    async def go() -> tuple[int, int, int]:
        redis = await connect(redis_url)
        try:
            admission = Admission(redis, stream, Rows(), rollout_batch_size=2, n_samples=2,
                                  max_staleness=0)  # type: ignore[arg-type]  # fmt: skip
            pump = asyncio.create_task(admission.fill(version=0))
            await asyncio.sleep(0)  # the pump is inside its publish now
            pump.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pump
            for _ in range(200):
                if await redis.xlen(stream) == 2:
                    break
                await asyncio.sleep(0.01)
            return admission.counts.admitted, len(admission.in_flight), await redis.xlen(stream)
        finally:
            await redis.aclose()

    assert asyncio.run(go()) == (2, 2, 2)


def test_a_fill_rides_out_redis_being_away_longer_than_the_clients_reconnects(tmp_path):
    """The groups a fill admits are counted and in flight before the publish: a Redis away for
    longer than the client's own reconnects (none, here) must not lose them (a trainer's
    admission that died on it left every batch wait without a group to come, seen in CI)."""
    import redis.asyncio as aioredis

    from millstream.trainer.admission import Admission
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path, appendonly=True)
    stream = RunKeys("away").prompts

    async def go() -> tuple[int, int, int]:
        redis = aioredis.Redis.from_url(server.url)  # no retries of its own
        try:
            await redis.ping()
            admission = Admission(redis, stream, Rows(), rollout_batch_size=2, n_samples=2,
                                  max_staleness=0)  # type: ignore[arg-type]  # fmt: skip
            server.proc.terminate()
            server.proc.wait(timeout=10)
            fill = asyncio.create_task(admission.fill(version=0))
            await asyncio.sleep(1.5)  # a publish or two fail meanwhile
            assert not fill.done()
            await asyncio.to_thread(server.start)
            await asyncio.wait_for(fill, timeout=15)
            return admission.counts.admitted, len(admission.in_flight), await redis.xlen(stream)
        finally:
            await redis.aclose()

    try:
        assert asyncio.run(go()) == (2, 2, 2)
    finally:
        server.stop()


def test_a_batch_wait_ends_with_the_error_of_a_feeder_that_died(redis_url):
    """The trainer's admission feeds the buffer: if it dies (its error unobserved in a task of
    its own), a wait for a batch must end with that error, not wait forever for groups that
    nobody publishes any more."""
    keys = RunKeys("feeder")

    async def go() -> None:
        redis = await connect(redis_url)
        buffer = make_buffer(redis, keys)
        await buffer.start()

        async def admission() -> None:
            await asyncio.sleep(0.3)
            raise ConnectionError("Redis went away for good")

        pump = asyncio.create_task(admission())
        buffer.watch_feeder(pump)
        try:
            with pytest.raises(ConnectionError, match="went away for good"):
                await asyncio.wait_for(buffer.take(2, version=0, max_lag=None), timeout=10)
        finally:
            await buffer.stop()
            await redis.aclose()

    asyncio.run(go())


def test_groups_an_earlier_run_with_this_run_id_left_in_the_streams_are_dropped(redis_url):
    """A fresh start of run id X (compose `up` again, a Swarm redeploy without --load) admits
    e0-i0, e0-i1, ... as the earlier run did; that run's groups still in `scored` and `dead`
    must not pass for this run's (they were sampled from other weights). Before run_instance:
    the buffer took the earlier run's e0-i0 as its own."""
    keys = RunKeys("earlier")
    ended: list[tuple[str, str]] = []

    def stamped(gid: str, instance: str, **kw) -> ScoredGroup:
        group = scored(gid, **kw)
        group.group.prompt.run_instance = instance
        return group

    async def go():
        redis = await connect(redis_url)
        buffer = Buffer(
            redis, keys, "trainer-test", claim_idle_ms=60_000, max_deliveries=3, block_ms=200,
            on_terminal=lambda gid, state: ended.append((gid, state)),
            expected=lambda gid: gid not in {g for g, _ in ended}, run_instance="new",
        )  # fmt: skip
        old_dead = PromptGroup(group_id="e0-i2", run_instance="old")
        await redis.xadd(
            keys.dead,
            {"data": old_dead.SerializeToString(), "source_stream": keys.prompts, "reason": "x"},
        )
        await streams.publish_many(
            redis, keys.scored,
            [stamped("e0-i0", "old"), stamped("e0-i1", "old", verdict=Verdict.VERDICT_FAILED),
             stamped("eval-a-r0-i0", "old", is_eval=True),
             stamped("e0-i0", "new"), stamped("e0-i1", "new"), stamped("eval-a-r0-i0", "new", is_eval=True)],
        )  # fmt: skip
        await buffer.start()
        try:
            batch = await asyncio.wait_for(buffer.take(2, version=3, max_lag=2), timeout=20)
            (evaluated,) = await asyncio.wait_for(buffer.wait_eval(["eval-a-r0-i0"]), timeout=20)
            for _ in range(100):  # the dead stream has a reader of its own
                if buffer.earlier_run == 4:
                    break
                await asyncio.sleep(0.1)
            return batch, evaluated, buffer.earlier_run
        finally:
            await buffer.stop()
            await redis.aclose()

    batch, evaluated, earlier = asyncio.run(go())
    assert [g.group.prompt.run_instance for g in batch] == ["new", "new"]
    assert evaluated.group.prompt.run_instance == "new"
    assert earlier == 4  # e0-i0, e0-i1 (failed), the eval group and the dead letter e0-i2
    assert sorted(ended) == [("e0-i0", "trained"), ("e0-i1", "trained")]
