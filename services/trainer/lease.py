"""One trainer per run: a lease in Redis with a fencing number.

An orchestrator that lost contact with a trainer's node starts another trainer while the
first may still run behind the partition (Swarm's restart policy, Kubernetes), and an operator
may deploy twice. Two trainers of one run would read the same stream, push weights to the same
engines and write the same checkpoint folder. So a trainer holds its run:

  * `{run}:lease`, a hash (fence, holder: host, pid, instance, since) that expires `--lease-ttl`
    seconds after its last renewal; the holder renews it every third of that.
  * `{run}:fence`, the run's fencing number: each new holder's is larger than every earlier
    one's (the larger of the last plus one and Redis' clock in milliseconds, so it grows even
    when Redis lost its data). The holder sends it on every admin call (common/fencing.py:
    routers and engines refuse a smaller one), it guards the buffer's acks and claims
    (streams.py `Fence`: a script compares it before it acks) and the renames that put a
    checkpoint in place (`check`).

A trainer that finds the run held waits until the lease expires (`--lease-held wait`, what an
orchestrator's restart needs) or exits 5 naming the holder (`exit`). A holder on this host whose
process is gone (a crash, a container restarted under the same hostname) is not waited for.
A holder that cannot renew (Redis unreachable) stops acting once the lease may have expired
(`valid_until`, counted from the send of its last renewal that succeeded) and renews again when
Redis is back: when nobody took the run meanwhile (the fencing number has not moved) it goes
on as before; when somebody did, it stops with LeaseLost (exit 5) and never trains on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from millstream.common.fencing import FencedOut, fence_headers
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import OUTAGE_ERRORS

log = logging.getLogger(__name__)

EXIT_CODE = 5
"""The exit code of a trainer that lost its run, or found it held with `--lease-held exit`."""

# KEYS: lease, fence. ARGV: holder JSON, ttl ms. {fence} when taken, else {0, holder, pttl}.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('HGET', KEYS[1], 'holder'), redis.call('PTTL', KEYS[1])}
end
local now = redis.call('TIME')
local clock = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local fence = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, clock)
redis.call('SET', KEYS[2], fence)
redis.call('HSET', KEYS[1], 'fence', fence, 'holder', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {fence}
"""

# KEYS: lease, fence. ARGV: fence, ttl ms, holder JSON. 1: renewed; 2: it had expired and
# nobody took the run since, so it is ours again; 0: a newer holder has it.
_RENEW = """
local held = redis.call('HGET', KEYS[1], 'fence')
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not held and redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'holder', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 2
end
return 0
"""

# KEYS: lease. ARGV: the holder JSON expected. Deletes a stale holder's lease (same host, its
# process gone), and only that one.
_TAKE_STALE = """
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS: lease. ARGV: fence. A holder that ends lets the run go at once.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'fence') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseLost(FencedOut):
    """The run is held by another trainer: this one lost it, or found it held and was told
    not to wait (`--lease-held exit`)."""

    exit_code = EXIT_CODE


def describe(holder: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return (
        f"the trainer on {holder.get('host', '?')} (pid {holder.get('pid', '?')}, "
        f"instance {holder.get('instance', '?')}), since {since}"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's process: alive
        return True
    return True


class Lease:
    """The trainer's hold on its run (module docstring). `acquire`, then `keep` in a task for
    as long as the trainer acts; `check` before a side effect that nothing else fences;
    `release` at a clean end."""

    def __init__(
        self,
        redis: Any,
        keys: RunKeys,
        ttl_s: float,
        *,
        held: str = "wait",
        say: Callable[[str], None] = lambda line: print(f"[trainer] {line}", flush=True),
    ):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s (--lease-ttl) must be > 0 (got {ttl_s})")
        self.redis, self.keys, self.ttl_s, self.held, self.say = redis, keys, ttl_s, held, say
        self.key, self.fence_key = keys.lease, keys.fence
        self.holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "instance": uuid.uuid4().hex[:12],
            "since": time.time(),
        }
        self.fence: int | None = None
        self.valid_until = 0.0  # monotonic: the lease may have expired after this
        self.lost: str | None = None  # why, once another holder has the run
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._take_stale = redis.register_script(_TAKE_STALE)
        self._release = redis.register_script(_RELEASE)

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    @property
    def headers(self) -> dict[str, str]:
        """The fencing header of this holder's admin calls (common/fencing.py)."""
        return fence_headers(self.keys.run_id, self.fence)

    def _holder_json(self) -> str:
        return json.dumps(self.holder, sort_keys=True)

    async def acquire(self, poll_s: float = 1.0) -> int:
        """Take the run; its fencing number. Waits while another trainer holds it (or raises
        LeaseLost with `held="exit"`), saying so once, then every minute and whenever the
        holder changes."""
        ttl_ms = int(self.ttl_s * 1000)
        said_at: float | None = None  # said once, again every minute or for a new holder
        said_of: dict[str, Any] = {}
        waiting_since = time.monotonic()
        while True:
            sent = time.monotonic()
            reply = await self._acquire(
                keys=[self.key, self.fence_key], args=[self._holder_json(), ttl_ms]
            )
            if int(reply[0]):
                self.fence, self.valid_until = int(reply[0]), sent + self.ttl_s
                if said_at is not None:
                    self.say(
                        f"run {self.keys.run_id}: the lease is ours after "
                        f"{time.monotonic() - waiting_since:.0f} s (fencing number {self.fence})"
                    )
                return self.fence
            raw, pttl = reply[1], int(reply[2])
            raw = raw.decode() if isinstance(raw, bytes) else raw
            other = json.loads(raw) if raw else {}
            if self._stale(other):
                self.say(f"run {self.keys.run_id}: {describe(other)} is gone; taking the run")
                await self._take_stale(keys=[self.key], args=[raw])
                continue
            where = (
                f"run {self.keys.run_id} is held by {describe(other)}; its lease expires "
                f"{max(pttl, 0) / 1000:.0f} s after its last renewal unless renewed"
            )
            if self.held == "exit":
                raise LeaseLost(
                    f"{where}. One trainer per run: stop that one, wait for it to end, or "
                    "start this one with --lease-held wait"
                )
            if said_at is None or time.monotonic() - said_at >= 60 or other != said_of:
                said_at, said_of = time.monotonic(), other
                self.say(
                    f"{where}; waiting for it (--lease-held wait; --lease-held exit stops "
                    f"instead), {said_at - waiting_since:.0f} s so far"
                )
            await asyncio.sleep(min(poll_s, max(pttl, 1) / 1000))

    def _stale(self, other: dict[str, Any]) -> bool:
        """A holder on this host whose process is gone, or an earlier life of this process'
        pid (a container restarted under its hostname): nobody to wait for."""
        if other.get("host") != self.holder["host"] or "pid" not in other:
            return False
        pid = int(other["pid"])
        return other.get("instance") != self.holder["instance"] and (
            pid == os.getpid() or not _pid_alive(pid)
        )

    async def renew(self) -> bool:
        """One renewal, bounded by a third of the TTL; True when the lease is ours (again).
        Raises LeaseLost when another holder has the run."""
        assert self.fence is not None, "acquire first"
        sent = time.monotonic()
        try:
            async with asyncio.timeout(self.renew_every_s):
                answer = int(
                    await self._renew(
                        keys=[self.key, self.fence_key],
                        args=[self.fence, int(self.ttl_s * 1000), self._holder_json()],
                    )
                )
        except (TimeoutError, *OUTAGE_ERRORS) as err:  # Redis away: try again later
            log.warning("run %s: lease renewal failed: %s", self.keys.run_id, err or "timed out")
            return False
        if answer == 0:
            self.lost = (
                f"run {self.keys.run_id}: lost the lease (fencing number {self.fence}): "
                "another trainer took the run while this one could not renew it; stopping "
                "without training on"
            )
            raise LeaseLost(self.lost)
        if answer == 2:
            self.say(
                f"run {self.keys.run_id}: the lease had expired, nobody took the run: ours again"
            )
        self.valid_until = sent + self.ttl_s
        return True

    async def keep(self) -> None:
        """Renew every third of the TTL until cancelled; raises LeaseLost when lost."""
        while True:
            await asyncio.sleep(self.renew_every_s)
            await self.renew()

    def valid(self) -> bool:
        return self.lost is None and self.fence is not None and time.monotonic() < self.valid_until

    def check(self) -> None:
        """Raise LeaseLost unless the lease is surely still ours (nobody else can hold it
        before `valid_until`). Synchronous: for the checkpoint's rename, in its thread."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if not self.valid():
            raise LeaseLost(
                f"run {self.keys.run_id}: the lease may have expired (not renewed for "
                f"{self.ttl_s:g} s, --lease-ttl): another trainer may hold the run"
            )

    async def ready(self) -> None:
        """Before a side effect: return at once while the lease is valid; else renew until it
        is (Redis back, nobody took the run) or LeaseLost."""
        while not self.valid():
            if self.lost is not None:
                raise LeaseLost(self.lost)
            if not await self.renew():
                await asyncio.sleep(min(1.0, self.renew_every_s))

    async def release(self) -> None:
        """Let the run go at a clean end: the next trainer of this run id need not wait."""
        if self.fence is None or self.lost is not None:
            return
        try:
            async with asyncio.timeout(self.renew_every_s):
                await self._release(keys=[self.key], args=[self.fence])
        except Exception as err:  # it expires on its own
            log.warning("run %s: could not release the lease: %s", self.keys.run_id, err)
