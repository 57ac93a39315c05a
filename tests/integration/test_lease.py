"""One trainer per run (trainer/lease.py) against a real Redis: the lease, its fencing number,
and the buffer's fenced acks and claims (streams.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import redis.asyncio as aioredis

from millstream.common.fencing import FencedOut
from millstream.common.keys import GROUP_TRAINER, RunKeys
from millstream.common.streams import Consumer
from millstream.trainer.lease import Lease, LeaseLost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEYS = RunKeys("leased")


def _quiet(_line: str) -> None:
    pass


async def _client(redis_url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(redis_url)


def test_a_second_trainer_exits_naming_the_holder_or_waits_and_takes_over(redis_url: str):
    async def go() -> None:
        redis = await _client(redis_url)
        lines: list[str] = []
        first = Lease(redis, KEYS, ttl_s=1.5, say=_quiet)
        first.holder["host"] = "node-a"  # as from another host: not taken as stale
        f1 = await first.acquire()
        assert first.valid() and first.headers == {"X-Millstream-Fence": f"leased/{f1}"}

        refused = Lease(redis, KEYS, ttl_s=1.5, held="exit", say=_quiet)
        with pytest.raises(LeaseLost) as err:
            await refused.acquire()
        assert f"held by the trainer on node-a (pid {first.holder['pid']}" in str(err.value)
        assert LeaseLost.exit_code == 5

        # The first stops renewing (a partition): the second waits, then takes the run.
        second = Lease(redis, KEYS, ttl_s=1.5, say=lines.append)
        f2 = await asyncio.wait_for(second.acquire(poll_s=0.1), timeout=10)
        assert f2 > f1
        assert "held by the trainer on node-a" in lines[0] and "waiting for it" in lines[0]
        assert "the lease is ours" in lines[-1]
        # The first comes back: its renewal finds the run taken; it may do nothing more.
        with pytest.raises(LeaseLost, match="lost the lease"):
            await first.renew()
        with pytest.raises(LeaseLost):
            first.check()
        assert await second.renew() and second.valid()
        await second.release()
        assert await redis.exists(KEYS.lease) == 0
        await redis.aclose()

    asyncio.run(go())


def test_an_expired_lease_nobody_took_is_renewed_and_a_dead_local_holder_is_not_waited_for(
    redis_url: str,
):
    async def go() -> None:
        redis = await _client(redis_url)
        lease = Lease(redis, KEYS, ttl_s=0.5, say=_quiet)
        fence = await lease.acquire()
        await asyncio.sleep(0.7)  # expired in Redis; nobody took the run
        assert not lease.valid()
        assert await lease.renew() and lease.valid() and lease.fence == fence

        # A holder on this host whose process is gone: taken at once, with a larger number.
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        holder = {**lease.holder, "pid": int(dead.stdout), "instance": "gone"}
        await redis.hset(KEYS.lease, "holder", json.dumps(holder, sort_keys=True))
        await redis.pexpire(KEYS.lease, 60_000)
        after = Lease(redis, KEYS, ttl_s=60, held="exit", say=_quiet)
        assert await asyncio.wait_for(after.acquire(), timeout=5) > fence
        await redis.aclose()

    asyncio.run(go())


def test_an_older_holders_ack_and_claim_are_refused_and_change_nothing(redis_url: str):
    """The buffer's consumer acks and claims through fenced scripts: after a newer trainer
    took the run, the old one's ack leaves the entry pending and its claim takes nothing."""

    async def go() -> None:
        redis = await _client(redis_url)
        old, new = Lease(redis, KEYS, 60, say=_quiet), None
        f_old = await old.acquire()

        def consumer(name: str, fence: int) -> Consumer:
            return Consumer(redis, KEYS.scored, GROUP_TRAINER, name, claim_idle_ms=50,
                            max_deliveries=5, dead_stream=KEYS.dead, block_ms=100,
                            fence=(KEYS.fence, fence))  # fmt: skip

        mine = consumer("trainer-old", f_old)
        await mine.ensure_group()
        for i in range(3):
            await redis.xadd(KEYS.scored, {"data": f"g{i}".encode()})
        first, second, third = await mine.read(3)
        assert await mine.ack(first)  # still the holder: acked

        # A newer trainer takes the run (the old lease expired behind a partition).
        await redis.delete(KEYS.lease)
        new = Lease(redis, KEYS, 60, say=_quiet)
        f_new = await new.acquire()
        assert f_new > f_old
        with pytest.raises(FencedOut, match="newer trainer"):
            await mine.ack(second)
        pending = await redis.xpending(KEYS.scored, GROUP_TRAINER)
        assert pending["pending"] == 2  # the refused ack changed nothing

        await asyncio.sleep(0.1)  # idle past claim_idle_ms
        theirs = consumer("trainer-new", f_new)
        taken = await theirs.read(10)
        assert sorted(e.id for e in taken) == sorted([second.id, third.id])
        mine._next_claim = 0.0
        with pytest.raises(FencedOut):
            await asyncio.sleep(0.1)
            await mine.read(10)  # its claim is refused: the new holder keeps them
        rows = await redis.xpending_range(KEYS.scored, GROUP_TRAINER, "-", "+", 10)
        assert {r["consumer"] for r in rows} == {b"trainer-new"}
        assert all(await asyncio.gather(*(theirs.ack(e) for e in taken)))
        await redis.aclose()

    asyncio.run(go())


def test_an_older_holders_checkpoint_is_not_put_in_place(redis_url: str, tmp_path):
    """Trainer.save hands the lease's check to the checkpoint's rename (checkpoints/atomic.py):
    a holder that lost the run writes nothing its successor would load."""
    from millstream.trainer.checkpoints import checkpoint

    class Weights:  # what a backend's save writes, small
        def save(self, path, save_optimizer: bool) -> None:
            (path / "model.safetensors").write_bytes(b"weights")

    async def go() -> None:
        redis = await _client(redis_url)
        old = Lease(redis, KEYS, 60, say=_quiet)
        await old.acquire()
        checkpoint.save(tmp_path, 1, Weights(), {}, False, before_commit=old.check)
        await redis.delete(KEYS.lease)
        await Lease(redis, KEYS, 60, say=_quiet).acquire()  # a newer trainer
        with pytest.raises(LeaseLost):
            await old.renew()
        with pytest.raises(LeaseLost):
            checkpoint.save(tmp_path, 2, Weights(), {}, False, before_commit=old.check)
        assert checkpoint.latest_iteration(tmp_path) == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "iter_0000001",
            "latest_checkpointed_iteration.txt",
        ]
        await redis.aclose()

    asyncio.run(go())
