"""The one worker shape every stream consumer uses (rollout, reward, the trainer's buffer).

Loop: poll (take over idle entries, then read new ones) -> dead-letter poison entries -> run
each entry's job as its own asyncio task, never more than `concurrency` at once -> reap
finished jobs and surface their errors. Beside the loop a ticker beats the heartbeat key and
renews the lease on in-flight entries. `stop()` (SIGTERM/SIGINT after
`install_signal_handlers()`) stops claiming and drains in-flight jobs, bounded by a timeout.

The handler contract:

* `await handler(entry)` owns the entry. A handler that produces output hands it off with
  `consumer.publish_and_ack(out_stream, message, trace_fields, entry)`: the ack and the publish
  happen together, exactly once per entry (see `millstream.common.streams`). It does not ack
  separately. With `auto_ack=True` the worker acks after the handler returns instead, for
  handlers that publish nothing on a stream (the trainer's buffer, sinks). With
  `check_entries=False` every entry reaches the handler as is (the dead-letter reader).
* A handler that raises leaves the entry unacked: it is logged with its traceback, counted in
  `failed`, re-delivered by XAUTOCLAIM after `claim_idle_ms`, and dead-lettered once it has
  been delivered more than `max_deliveries` times.
* A handler that raises `PoisonEntry` (e.g. from `decode`) gets its entry dead-lettered at once
  with that reason: retrying cannot fix bad bytes. Entries without data or with an unknown
  schema version never reach the handler.

Leases: XAUTOCLAIM cannot tell a dead consumer from a slow one, so the ticker resets the idle
time of this worker's in-flight entries every claim_idle_ms/3 (`Consumer.renew`); a live job
longer than `--claim-idle-ms` is not taken over, and its delivery count does not climb.

Redis outages: every Redis call here rides out an outage of up to --redis-outage-timeout
(`redis_conn.Outages`): the reader, the ticker and each job's hand-off wait for Redis to come
back, and in-flight jobs run on meanwhile and hand off after it; the first read after a
reconnect takes back this consumer's pending entries that no job holds (`Consumer.read`).
Past the timeout the worker drains and `run()` raises `RedisGone`. A full Redis (OOM under
noeviction) holds a hand-off or a read no longer than it holds any write that waits for room
(redis_conn.py); the heartbeat alone does not wait: a beat refused for want of memory is
skipped, said once, and the next one is sent a tick later.

Invariant: an entry is acked only by its handler's hand-off (or by the worker after a clean
return in auto-ack mode) or by dead-lettering; a crash, a cancel or a timeout leaves it pending
for another consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import aio
from .errors import Interrupted, ServiceUnavailable
from .fencing import FencedOut
from .redis_conn import not_waiting_for_room
from .streams import Consumer, PoisonEntry, StreamEntry, check_envelope

log = logging.getLogger(__name__)

_CANCEL_GRACE_S = 1.0
_GOODBYE_S = 2.0
"""Bound on the last Redis calls of a stopping worker (heartbeat delete, last renew): a
worker whose Redis went away with its parent still exits at once."""
REDIS_LOST = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisGone(ServiceUnavailable):
    """Redis stayed unreachable longer than --redis-outage-timeout."""


Handler = Callable[[StreamEntry], Awaitable[None]]
Heartbeat = tuple[aioredis.Redis, str, int]
"""(client, key, ttl seconds): the key lives while the worker beats it every ttl/3 s."""


class StreamWorker:
    """Runs `handler` on every entry `consumer` delivers; see the module docstring."""

    def __init__(
        self,
        consumer: Consumer,
        handler: Handler,
        *,
        concurrency: int,
        name: str,
        heartbeat: Heartbeat | None = None,
        auto_ack: bool = False,
        check_entries: bool = True,
        drain_timeout_s: float = 10.0,
        on_stop: Callable[[], None] | None = None,
    ):
        if concurrency <= 0:
            raise ValueError(f"concurrency must be > 0 (got {concurrency})")
        self.consumer = consumer
        self.handler = handler
        self.concurrency = concurrency
        self.name = name
        self.heartbeat = heartbeat
        self.auto_ack = auto_ack
        self.check_entries = check_entries
        self.on_stop = on_stop
        self.drain_timeout_s = drain_timeout_s
        self.processed = 0
        self.failed = 0
        self.poisoned = 0
        self._in_flight: dict[asyncio.Task[None], StreamEntry] = {}
        self._in_flight_ids: set[str] = set()
        self._stopping = asyncio.Event()
        self._ticks_done = asyncio.Event()
        self._ticker: asyncio.Task[None] | None = None
        self._signals: list[signal.Signals] = []
        # Renew leases well inside claim_idle_ms so no one takes over a live job.
        tick_s = consumer.claim_idle_ms / 3000
        self._tick_s = min(tick_s, heartbeat[2] / 3) if heartbeat else tick_s

    @property
    def dead_lettered(self) -> int:
        """Entries dead-lettered by this worker: poison ones and over-delivered ones."""
        return self.consumer.dead_lettered

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def stop(self) -> None:
        """Stop claiming; `run()` drains in-flight jobs and returns."""
        if not self._stopping.is_set():
            log.info("%s: stopping, draining %d in-flight jobs", self.name, len(self._in_flight))
            if self.on_stop is not None:
                self.on_stop()
        self._stopping.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT call `stop()`; call from inside the running event loop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
            self._signals.append(sig)

    async def run(self) -> None:
        """Consume until `stop()`, then drain. Redis errors propagate (after the drain)."""
        await self.consumer.ensure_group()
        ticker = self._ticker = asyncio.create_task(self._tick(), name=f"{self.name}:ticker")
        log.info("%s: consuming %s as %s", self.name, self.consumer.stream, self.consumer.name)
        try:
            while not self._stopping.is_set() and not ticker.done():
                try:
                    free = await self._free_slots()
                    entries = await self._read(free) if free else []
                    for entry in entries:
                        await self._start(entry)
                    await self._reap()
                except REDIS_LOST as err:  # the outage outlasted --redis-outage-timeout
                    raise self._redis_gone(err) from None
        finally:
            await self._drain()
            # The ticker is told to stop, never cancelled: see _tick.
            self._ticks_done.set()
            await asyncio.wait([ticker], timeout=_GOODBYE_S)
            await self._say_goodbye()
        if ticker.done():
            ticker.result()  # it only ends early by failing: surface why

    async def _read(self, count: int) -> list[StreamEntry]:
        """One blocking read, cut short by `stop()`: stopping waits for no --stream-block-ms.

        Entries Redis hands over just as the read is cancelled stay pending under this
        consumer and are taken over after claim_idle_ms, as after a crash: nothing is lost."""
        held = list(self._in_flight_ids)
        read = asyncio.ensure_future(self.consumer.read(count=count, held=held))
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not read.done():
                read.cancel()
        (result,) = await asyncio.gather(read, return_exceptions=True)
        if isinstance(result, asyncio.CancelledError):
            return []
        if isinstance(result, REDIS_LOST):
            if self._stopping.is_set():
                return []
            raise self._redis_gone(result)
        if isinstance(result, BaseException):
            raise result
        return result  # what arrived as we stopped still runs (and drains)

    async def _free_slots(self) -> int:
        """Free job slots; when none, wait for a job to finish (or stop) and report 0.

        Claiming only what we can start at once keeps entries from sitting unstarted in our
        pending list, where other consumers could have run them: the in-flight set is the
        semaphore.
        """
        free = self.concurrency - len(self._in_flight)
        if free > 0:
            return free
        stop_wait = asyncio.create_task(self._stopping.wait())
        wake = [*self._in_flight, stop_wait, *([self._ticker] if self._ticker else [])]
        try:
            await asyncio.wait(wake, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
            await asyncio.gather(stop_wait, return_exceptions=True)
        return 0

    async def _start(self, entry: StreamEntry) -> None:
        if entry.id in self._in_flight_ids:
            # Taken back from ourselves (a lease renewal came too late): one run is enough.
            return
        try:
            if self.check_entries:
                check_envelope(entry)
        except PoisonEntry as err:
            await self._poisoned(entry, err)
            return
        task = asyncio.create_task(self._job(entry), name=f"{self.name}:{entry.id}")
        self._in_flight[task] = entry
        self._in_flight_ids.add(entry.id)

    async def _job(self, entry: StreamEntry) -> None:
        await self.handler(entry)
        if self.auto_ack:
            await self.consumer.ack(entry)

    async def _reap(self) -> None:
        for task in [task for task in self._in_flight if task.done()]:
            entry = self._in_flight.pop(task)
            self._in_flight_ids.discard(entry.id)
            if task.cancelled():
                log.warning("%s: job for entry %s cancelled; left pending", self.name, entry.id)
                continue
            err = task.exception()
            if err is None:
                self.processed += 1
            elif _interrupted(err):
                log.info("%s: entry %s left pending (the job stopped with us)", self.name, entry.id)
            elif isinstance(err, PoisonEntry):
                await self._poisoned(entry, err)
            elif isinstance(err, FencedOut):  # a newer trainer holds the run: stop here
                raise err
            else:
                self.failed += 1
                log.error(
                    "%s: handler failed on entry %s of %s (delivery %d of at most %d); left "
                    "pending for redelivery",
                    self.name,
                    entry.id,
                    entry.stream,
                    entry.deliveries,
                    self.consumer.max_deliveries,
                    exc_info=err,
                )

    async def _poisoned(self, entry: StreamEntry, err: PoisonEntry) -> None:
        self.poisoned += 1
        log.error("%s: dead-lettering poison entry %s: %s", self.name, entry.id, err.reason)
        await self.consumer.dead_letter(entry, err.reason)

    async def _drain(self) -> None:
        if self._in_flight:
            _done, late = await asyncio.wait(self._in_flight, timeout=self.drain_timeout_s)
            if late:
                await self._cancel_late(late)
        await self._reap()
        for sig in self._signals:
            asyncio.get_running_loop().remove_signal_handler(sig)
        self._signals.clear()

    async def _cancel_late(self, late: set[asyncio.Task[None]]) -> None:
        log.warning(
            "%s: cancelling %d jobs still running after the %.1f s drain timeout; their "
            "entries stay pending for another consumer",
            self.name,
            len(late),
            self.drain_timeout_s,
        )
        for task in late:
            task.cancel()
        # On Python 3.11 a cancel can be lost inside a Redis call (asyncio.wait_for returns
        # the result when the cancel and the reply arrive together), so the wait is bounded.
        _done, deaf = await asyncio.wait(late, timeout=_CANCEL_GRACE_S)
        if deaf:
            log.error(
                "%s: %d jobs ignored cancellation; leaving them behind (an entry they hand "
                "off later is still handed off at most once)",
                self.name,
                len(deaf),
            )

    async def _tick(self) -> None:
        """Beat and renew leases every tick until told to stop. It is stopped by an event,
        not cancelled, because redis-py on Python 3.11 can swallow a cancel (see above)."""
        full = False  # the last beat was refused for want of memory (said once)
        while not self._ticks_done.is_set():
            try:
                try:
                    await self._beat()
                    full = False
                except OutOfMemoryError as err:  # a full Redis: skip this beat, not the renew
                    if not full:
                        log.warning("%s: heartbeat skipped, Redis is full: %s", self.name, err)
                    full = True
                await self.consumer.renew(list(self._in_flight.values()))
            except REDIS_LOST as err:  # past --redis-outage-timeout: the reader stops us
                log.warning("%s: heartbeat failed, Redis unreachable: %s", self.name, err)
            with contextlib.suppress(TimeoutError):
                await aio.wait_for(self._ticks_done.wait(), self._tick_s)

    async def _beat(self) -> None:
        if self.heartbeat is None:
            return
        client, key, ttl_s = self.heartbeat
        state = {
            "name": self.name,
            "consumer": self.consumer.name,
            "in_flight": len(self._in_flight),
            "processed": self.processed,
            "failed": self.failed,
            "dead_lettered": self.dead_lettered,
            "unix": time.time(),
        }
        with not_waiting_for_room():
            await client.set(key, json.dumps(state), ex=ttl_s)

    def _redis_gone(self, err: BaseException) -> RedisGone:
        outages, reason = self.consumer.outages, str(err).rstrip(".")
        return RedisGone(
            f"{self.name}: Redis at {outages.url} is unreachable ({reason}), also after "
            f"reconnecting for {outages.timeout_s:g} s (--redis-outage-timeout); stopping. "
            "Its entries stay pending for other consumers."
        )

    async def _say_goodbye(self) -> None:
        if self.heartbeat is not None:
            client, key, _ttl_s = self.heartbeat
            try:  # the key expires by itself if Redis is not there to delete it
                await aio.wait_for(client.delete(key), _GOODBYE_S)
            except (TimeoutError, *REDIS_LOST):
                pass
        log.info(
            "%s: stopped (processed %d, failed %d, dead-lettered %d)",
            self.name,
            self.processed,
            self.failed,
            self.dead_lettered,
        )


def _interrupted(err: BaseException) -> bool:
    """The job gave up because the worker stops (also inside an exception group)."""
    if isinstance(err, BaseExceptionGroup):
        return err.subgroup(Interrupted) is not None
    return isinstance(err, Interrupted)
