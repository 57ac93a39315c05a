"""Redis stream producer and consumer: the envelope, delivery, hand-off and dead-lettering.

Owns the wire format of every stream entry (docs/architecture.md): `data` = protobuf bytes,
`traceparent`/`tracestate` = W3C trace context (may be empty), `v` = schema version. No pickle.

Invariants it keeps:

* At-least-once delivery: an entry leaves a group's pending list only by an ack, and an entry
  whose consumer died is taken over with XAUTOCLAIM once it has been idle `claim_idle_ms`.
* Exactly-once hand-off: `Consumer.publish_and_ack` acks the input and publishes the output in
  one Lua script that publishes only if the ack removed the entry from the pending list. A slow
  consumer whose entry was taken over (and already handed off by the new owner) publishes
  nothing, so each input yields at most one output, and at least one because nothing is acked
  before its output exists. Hand-offs a worker's jobs make in the same event-loop turn go to
  Redis in one pipeline (`TurnBatch`, acks too): one round trip for a burst of finished groups
  (an eval's 200 of them), each script still atomic on its own.
* Nothing is lost to an outage: a Redis call that meets one is sent again until Redis is
  back or `--redis-outage-timeout` has passed (`redis_conn.Outages`: single commands by the
  client, pipelines here). A read whose reply was lost with the connection left its entries
  pending under this consumer, where no one else looks before `claim_idle_ms`: after every
  reconnect (and at start) a consumer first takes back its own pending entries that no live
  job of its worker holds (`_TAKE_BACK_OWN`), so none waits and none runs twice at once.
* Nothing is lost to dead-lettering: an entry delivered more than `max_deliveries` times, or
  one that cannot be decoded, is copied to `{run}:dead` with the reason in the same script
  that acks it.
* A fenced consumer (the trainer's, `fence`: its run's fencing-number key and its own number,
  trainer/lease.py) acks and claims through scripts that first compare the run's number with
  its own: once a newer trainer holds the run, an older one's ack or claim changes nothing and
  raises FencedOut, so it cannot take groups from the new holder or mark them done.
* Trimming never removes an entry a consumer group still needs (`trim_safely`), and a
  consumer is deleted only when it owns no pending entry (`delete_idle_consumers`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError, Message
from redis.exceptions import ResponseError

from .config import RunConfig
from .errors import MillstreamError
from .fencing import FencedOut
from .keys import RunKeys
from .redis_conn import outages_of
from .stream_scripts import (
    ACK_AND_ADD,
    DELETE_IDLE_CONSUMERS,
    FENCED_ACK,
    FENCED_AUTOCLAIM,
    RENEW,
    TAKE_BACK_OWN,
    TRIM,
)
from .turn_batch import TurnBatch

SCHEMA_VERSION = 1
"""Version of the entry envelope and its protobuf payloads; consumers refuse other versions."""

M = TypeVar("M", bound=Message)


@contextlib.contextmanager
def _fenced() -> Iterator[None]:
    """A fenced script's refusal (stream_scripts._FENCE_GUARD) as FencedOut."""
    try:
        yield
    except ResponseError as err:
        if not str(err).startswith("FENCED"):
            raise
        raise FencedOut(
            f"a newer trainer holds this run ({str(err).removeprefix('FENCED ')}): this one "
            "lost the lease, and its acks and claims are refused; stopping without training on"
        ) from None


class PoisonEntry(MillstreamError):
    """An entry no consumer can ever process; it is dead-lettered at once with `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class StreamEntry:
    """One delivered entry. `data` is None when the entry has no data field (a poison entry)."""

    stream: str
    id: str
    data: bytes | None
    traceparent: str
    tracestate: str
    v: str
    deliveries: int
    fields: Mapping[bytes, bytes] = field(default_factory=dict, repr=False, compare=False)

    @property
    def trace_fields(self) -> dict[str, str]:
        """The trace context fields, for `telemetry.context_from_fields`."""
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def default_consumer_name(kind: str) -> str:
    """A consumer name unique to this process: `kind-host-pid`."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}"


def entry_fields(message: Message, trace_fields: Mapping[str, str] | None = None) -> dict:
    """The fields of a new entry carrying `message`."""
    trace = trace_fields or {}
    return {
        "data": message.SerializeToString(),
        "traceparent": trace.get("traceparent", ""),
        "tracestate": trace.get("tracestate", ""),
        "v": str(SCHEMA_VERSION),
    }


async def publish(
    redis: aioredis.Redis,
    stream: str,
    message: Message,
    trace_fields: Mapping[str, str] | None = None,
) -> str:
    """XADD one message; returns the new entry id."""
    return _str(await redis.xadd(stream, entry_fields(message, trace_fields)))


async def publish_many(
    redis: aioredis.Redis,
    stream: str,
    messages: Iterable[Message],
    trace_fields: Mapping[str, str] | list[Mapping[str, str]] | None = None,
) -> list[str]:
    """XADD many messages in one round trip and one MULTI/EXEC; returns their ids. Sent
    again whole while Redis is away (a repeat after a lost reply adds them twice: group
    ids dedupe downstream).

    `trace_fields` is one context for all, or a list with one per message (one trace each).
    In a transaction, a consumer blocked on the stream wakes once, with all of them: without
    it, Redis woke it after the first XADD, and it read the rest a round trip later (so the
    rollout worker's batching of a batch's groups into one request needed a timer).
    """
    messages = list(messages)
    per_message = trace_fields if isinstance(trace_fields, list) else [trace_fields] * len(messages)
    if len(per_message) != len(messages):
        raise ValueError(f"{len(messages)} messages but {len(per_message)} trace contexts")

    async def send() -> list:
        async with redis.pipeline(transaction=True) as pipe:
            for message, trace in zip(messages, per_message, strict=True):
                pipe.xadd(stream, entry_fields(message, trace))
            return await pipe.execute()

    return [_str(entry_id) for entry_id in await outages_of(redis).call(send)]


def check_envelope(entry: StreamEntry) -> None:
    """Raise PoisonEntry when the entry lacks data or carries an unknown schema version."""
    where = f"entry {entry.id} on {entry.stream}"
    if entry.data is None:
        raise PoisonEntry(f"{where} has no data field")
    if entry.v != str(SCHEMA_VERSION):
        raise PoisonEntry(
            f"{where} has unknown schema version v={entry.v!r} (this consumer reads "
            f"v={SCHEMA_VERSION}); upgrade the consumer or re-publish the entry"
        )


def decode(entry: StreamEntry, message_type: type[M]) -> M:
    """The entry's message, or PoisonEntry saying why it cannot be one."""
    check_envelope(entry)
    assert entry.data is not None  # check_envelope raised otherwise
    try:
        return message_type.FromString(entry.data)
    except DecodeError as err:
        raise PoisonEntry(
            f"data of entry {entry.id} on {entry.stream} is not a valid "
            f"{message_type.DESCRIPTOR.full_name}: {err}"
        ) from err


def _pairs(flat: list) -> dict:
    """A script's field list [k1, v1, k2, v2, ...] as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _to_entry(stream: str, entry_id: bytes | str, fields: dict, deliveries: int) -> StreamEntry:
    return StreamEntry(
        stream=stream,
        id=_str(entry_id),
        data=fields.get(b"data"),
        traceparent=_str(fields.get(b"traceparent", b"")),
        tracestate=_str(fields.get(b"tracestate", b"")),
        v=_str(fields.get(b"v", b"")),
        deliveries=deliveries,
        fields=fields,
    )


async def trim_safely(redis: aioredis.Redis, stream: str, *, approximate: bool = True) -> int:
    """Trim `stream` below the oldest entry any consumer group still needs; returns how many
    entries were removed.

    A group needs its oldest pending (delivered, unacked) entry and everything after its
    last-delivered id; we keep the last-delivered entry itself too, so one extra entry per
    group may survive, but no entry a group has not acked is ever removed. A stream without
    groups is never trimmed: a group created later from id 0 would need all of it. With
    `approximate` (XTRIM MINID ~) Redis removes only whole macro nodes, which is cheap and
    may leave some acked entries behind.
    """
    script = redis.register_script(TRIM)
    result = await script(keys=[stream], args=["~" if approximate else "="])
    return 0 if result is None else int(result[1])


async def delete_idle_consumers(redis: aioredis.Redis, stream: str, idle_ms: int) -> int:
    """Delete the consumers of every group of `stream` that own no pending entry and have
    been idle `idle_ms` or longer (workers that left); returns how many. A live consumer
    reads at least every --stream-block-ms, and one deleted by mistake is created again by
    its next read, so nothing depends on this but Redis memory."""
    script = redis.register_script(DELETE_IDLE_CONSUMERS)
    return int(await script(keys=[stream], args=[idle_ms]))


class Consumer:
    """One consumer of one group on one stream; see the module docstring for its guarantees.

    The client must return bytes (decode_responses=False), so protobuf payloads stay intact.
    `block_ms` must stay below the client's socket timeout (redis-py 8 defaults it to 5 s),
    or a blocking read with nothing to deliver fails with a TimeoutError.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        group: str,
        consumer_name: str,
        *,
        claim_idle_ms: int,
        max_deliveries: int,
        dead_stream: str,
        block_ms: int,
        fence: tuple[str, int] | None = None,
    ):
        if redis.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError(
                "stream consumers need a Redis client with decode_responses=False: entry data "
                "is binary protobuf"
            )
        self.redis = redis
        self.stream = stream
        self.group = group
        self.name = consumer_name
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.dead_stream = dead_stream
        self.block_ms = block_ms
        self.dead_lettered = 0
        self.outages = outages_of(redis)
        self._claim_cursor = "0-0"
        self._next_claim = 0.0  # monotonic time of the next XAUTOCLAIM (see `read`)
        # Where the walk of our own pending list is (None: not walking); from the start, so
        # a consumer restarted under its name runs what it held at once.
        self._own_cursor: str | None = "0-0"
        self._reconnects_seen = self.outages.reconnects
        self._batch = TurnBatch(redis, self.outages)
        self._ack_and_add = redis.register_script(ACK_AND_ADD)
        self._renew = redis.register_script(RENEW)
        self._take_back_own = redis.register_script(TAKE_BACK_OWN)
        self.fence = fence  # (the run's fence key, our number): acks and claims guarded
        self._fenced_ack = redis.register_script(FENCED_ACK)
        self._fenced_autoclaim = redis.register_script(FENCED_AUTOCLAIM)

    @classmethod
    def for_run(
        cls, redis: aioredis.Redis, cfg: RunConfig, stream: str, group: str, consumer_name: str
    ) -> Consumer:
        """A consumer with the run's --claim-idle-ms, --max-deliveries and --stream-block-ms,
        dead-lettering to `{run}:dead`."""
        s = cfg.service
        return cls(
            redis,
            stream,
            group,
            consumer_name,
            claim_idle_ms=s.claim_idle_ms,
            max_deliveries=s.max_deliveries,
            dead_stream=RunKeys(cfg.run_id).dead,
            block_ms=s.stream_block_ms,
        )

    async def ensure_group(self) -> None:
        """Create the group (and the stream) if missing, reading from the first entry."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    async def read(self, count: int, held: Collection[str] = ()) -> list[StreamEntry]:
        """Up to `count` entries: first our own pending ones that no live job holds (`held`:
        the ids our worker is running) after a reconnect, then those taken over from idle
        consumers, then new ones.

        Taken-back entries delivered more than `max_deliveries` times are dead-lettered here
        and not returned. Blocks up to `block_ms` only when nothing was taken back.
        """
        if count <= 0:
            return []
        if self.outages.reconnects != self._reconnects_seen:
            self._reconnects_seen = self.outages.reconnects
            self._own_cursor = "0-0"
        taken = await self._own(count, held) if self._own_cursor is not None else []
        # An entry becomes idle enough to take over claim_idle_ms after its last delivery, so
        # looking ten times per claim_idle_ms is enough (and one round trip less per read),
        # except while the cursor is still walking the pending list.
        if len(taken) < count and time.monotonic() >= self._next_claim:
            claimed = await self._claim(count - len(taken))
            if self._claim_cursor == "0-0" and not claimed:
                self._next_claim = time.monotonic() + self.claim_idle_ms / 10_000
            taken += claimed
        entries = [e for e in taken if not await self._over_delivered(e)]
        if len(entries) < count:
            block = None if entries or self.block_ms <= 0 else self.block_ms
            entries += await self._read_new(count - len(entries), block)
        return entries

    async def _own(self, count: int, held: Collection[str]) -> list[StreamEntry]:
        args = [self.group, self.name, self._own_cursor, count, *held]
        cursor, claimed, deliveries = await self._take_back_own(keys=[self.stream], args=args)
        self._own_cursor = None if cursor is None else _str(cursor)
        times = dict(zip(deliveries[::2], deliveries[1::2], strict=True))
        return [
            _to_entry(self.stream, entry_id, _pairs(flat), int(times[entry_id]))
            for entry_id, flat in claimed
            if flat  # None: deleted from the stream while pending (Redis 6.2)
        ]

    async def _claim(self, count: int) -> list[StreamEntry]:
        if self.fence is None:
            next_cursor, claimed, *_deleted = await self.redis.xautoclaim(
                self.stream,
                self.group,
                self.name,
                min_idle_time=self.claim_idle_ms,
                start_id=self._claim_cursor,
                count=count,
            )
        else:
            key, number = self.fence
            args = [number, self.group, self.name, self.claim_idle_ms, self._claim_cursor, count]
            with _fenced():
                next_cursor, raw, *_deleted = await self._fenced_autoclaim(
                    keys=[self.stream, key], args=args
                )
            claimed = [(entry_id, None if flat is None else _pairs(flat)) for entry_id, flat in raw]
        # The cursor walks the pending list across calls; "0-0" means it wrapped around.
        self._claim_cursor = _str(next_cursor)
        # Entries deleted from the stream while pending come back without fields (Redis 6.2)
        # or in the third element (7.0+), and Redis drops them from the pending list itself.
        claimed = [(entry_id, fields) for entry_id, fields in claimed if fields is not None]
        if not claimed:
            return []

        async def deliveries() -> list:
            async with self.redis.pipeline(transaction=False) as pipe:
                for entry_id, _ in claimed:
                    pipe.xpending_range(self.stream, self.group, entry_id, entry_id, 1)
                return await pipe.execute()

        pending = await self.outages.call(deliveries)
        # An entry acked by its previous owner between the claim and XPENDING has no row: skip.
        return [
            _to_entry(self.stream, entry_id, fields, int(rows[0]["times_delivered"]))
            for (entry_id, fields), rows in zip(claimed, pending, strict=True)
            if rows
        ]

    async def _over_delivered(self, entry: StreamEntry) -> bool:
        if entry.deliveries <= self.max_deliveries:
            return False
        await self.dead_letter(
            entry,
            f"delivered {entry.deliveries} times, more than --max-deliveries "
            f"{self.max_deliveries}; every attempt failed or its consumer died",
        )
        return True

    async def _read_new(self, count: int, block: int | None) -> list[StreamEntry]:
        response = await self.redis.xreadgroup(
            self.group, self.name, {self.stream: ">"}, count=count, block=block
        )
        if not response:
            return []
        if isinstance(response, dict):  # RESP3: {stream: [entries]}
            batches = [batch[0] for batch in response.values()]
        else:  # RESP2: [[stream, entries]]
            batches = [batch for _stream, batch in response]
        return [
            _to_entry(self.stream, entry_id, fields, 1)
            for batch in batches
            for entry_id, fields in batch
        ]

    async def ack(self, entry: StreamEntry) -> bool:
        """XACK; False when the entry was no longer pending (someone else acked it).
        Fenced: FencedOut once a newer trainer holds the run (nothing acked)."""
        if self.fence is None:
            return await self._batch.command("XACK", self.stream, self.group, entry.id) == 1
        key, number = self.fence
        with _fenced():
            answer = await self._batch.script(
                self._fenced_ack, [self.stream, key], [number, self.group, entry.id]
            )
        return answer == 1

    async def publish_and_ack(
        self,
        out_stream: str,
        message: Message,
        trace_fields: Mapping[str, str] | None,
        entry: StreamEntry,
    ) -> str | None:
        """Ack `entry` and publish `message` to `out_stream` atomically; None (and nothing
        published) when the entry was already acked by another consumer that took it over."""
        return await self._guarded_add(out_stream, entry_fields(message, trace_fields), entry)

    async def dead_letter(self, entry: StreamEntry, reason: str) -> str | None:
        """Copy the raw entry with the reason to the dead stream and ack it, atomically.
        None when another consumer had already acked it (then it is not dead)."""
        fields: dict[bytes | str, bytes | str] = dict(entry.fields)
        fields.update(
            source_stream=entry.stream,
            source_id=entry.id,
            group=self.group,
            reason=reason,
            deliveries=str(entry.deliveries),
        )
        dead_id = await self._guarded_add(self.dead_stream, fields, entry)
        if dead_id is not None:
            self.dead_lettered += 1
        return dead_id

    async def _guarded_add(
        self, out_stream: str, fields: Mapping, entry: StreamEntry
    ) -> str | None:
        args: list[bytes | str] = [self.group, entry.id]
        for key, value in fields.items():
            args += [key, value]
        new_id = await self._batch.script(self._ack_and_add, [self.stream, out_stream], args)
        return None if new_id is None else _str(new_id)

    async def renew(self, entries: list[StreamEntry]) -> int:
        """Reset the idle time of entries this consumer still owns, so a live consumer's long
        jobs are not taken over; returns how many were renewed."""
        if not entries:
            return 0
        args = [self.group, self.name, *(entry.id for entry in entries)]
        return int(await self._renew(keys=[self.stream], args=args))
