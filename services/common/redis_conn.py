"""Connect to Redis once, with a clear error naming the URL (never the password), and ride
out Redis outages.

Outages: every command of the client `connect` returns (a `Client`) that meets a dropped
connection, a timeout or a Redis still loading its AOF (`OUTAGE_ERRORS`) is sent again, with
backoff from 0.1 s doubling to 2 s, until Redis answers or the outage has lasted
`--redis-outage-timeout` (`Outages`, one per client, so one per process: every caller waits
on the same outage). The outage is said on the console once when it starts and once when it
ends ("[rollout-0] Redis at redis://...: reconnected after 14.8 s"); past the timeout the
last error reaches the caller, as without retries. Pipelines are not commands of the client:
`streams.py` sends each through `outages_of(client).call` whole. redis-py's own retry is kept
to one more try at once on a fresh connection: a pooled connection that a restart (already
over) left dead is replaced without a console line.

A full Redis (`maxmemory` reached under `maxmemory-policy noeviction`, which every Redis
millstream starts is given: evicting would drop stream entries without a trace) refuses writes
that add data with OOM while it still serves reads, acks and trims. Such a write waits for room
(`Outages.call`, backoff to 2 s), with no deadline of its own: room comes back as the trainer
takes groups and trims the streams. Said when it starts, every minute while it lasts, and when
it ends ("[trainer] Redis at redis://...: room again after 12.3 s"). A caller that must not
wait (a heartbeat: the next one will do) calls inside `not_waiting_for_room()` and gets the
OutOfMemoryError at once. Writes that only move data (XACK, XTRIM, XCLAIM, PEXPIRE) are never
refused, and neither is a script once it has written: the hand-off script acks first, so
hand-offs pass a full Redis (bounded by the groups in flight) and the run drains.

A command may run twice when its reply was lost; every write millstream makes is safe to
repeat (XADD duplicates are dropped by group id downstream, hand-offs are guarded scripts,
XACK is idempotent). A read whose reply was lost leaves its entries pending under the
consumer; `Consumer` takes those back after every reconnect (`Outages.reconnects`).

The first PING is not retried unless the caller asks to wait (`wait_s`): a stream worker,
which may start during a Redis restart and has nothing to do without it, and a trainer given
--redis-url, which may start before that Redis does (`docker stack deploy` orders nothing), for
--redis-outage-timeout. A wrong password fails at once, waiting or not.

Every write is bounded by the socket timeout with `asyncio.timeout`, not redis-py's
`asyncio.wait_for`, which on Python 3.11 loses a cancel that lands as the write ends
(`_CancelSafeWrites`, common/aio.py): a cancelled task must not go on with its next command.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import AuthenticationError, OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import ServiceUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

WORKER_WAIT_S = 60.0
"""How long a stream worker starting up waits for Redis to be reachable (a restart of Redis
while a worker is replaced, as in the chaos tests, must not kill the new worker)."""

OUTAGE_TIMEOUT_S = 120.0
"""--redis-outage-timeout's default."""

OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
"""What an outage looks like to a caller (BusyLoadingError, Redis loading its AOF, is a
ConnectionError)."""

FULL_SAY_EVERY_S = 60.0
"""While Redis stays full, say so again this often."""

_WAIT_FOR_ROOM: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "millstream_wait_for_room", default=True
)


@contextlib.contextmanager
def not_waiting_for_room() -> Iterator[None]:
    """Calls made inside (this task's) fail at once with OutOfMemoryError when Redis is full
    instead of waiting for room (module docstring)."""
    token = _WAIT_FOR_ROOM.set(False)
    try:
        yield
    finally:
        _WAIT_FOR_ROOM.reset(token)


class Outages:
    """Runs Redis calls through outages of up to `timeout_s`; see the module docstring.

    An outage starts at the first failed call (at the start of that call for a timeout: a
    stopped Redis is only noticed after the socket timeout) and ends at the first call that
    succeeds having started after it began. `reconnects` counts the outages ended.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = OUTAGE_TIMEOUT_S,
        who: str = "millstream",
        *,
        first_delay_s: float = 0.1,
        max_delay_s: float = 2.0,
        say: Callable[[str], None] | None = None,
    ):
        self.url = redact(url)
        self.timeout_s = timeout_s
        self.who = who
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s
        self.say = say or _print
        self.reconnects = 0
        self.fulls = 0  # times Redis was found full (writes refused with OOM), so far
        self._since: float | None = None  # the outage's start (monotonic), while one lasts
        self._full_since: float | None = None  # while Redis is full: when it was found so
        self._full_said = 0.0
        self._noticed = 0.0  # when it was noticed: only calls started later can end it
        self._gave_up = False

    def configure(self, *, who: str, timeout_s: float) -> None:
        """Name the process in the console lines and set --redis-outage-timeout (a worker
        learns it from the run config, read through this client)."""
        self.who = who
        self.timeout_s = timeout_s

    async def call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`await attempt()`, again after each outage error until the outage has lasted
        `timeout_s`; then that error is raised. `attempt` makes a new call each time."""
        delay = self.first_delay_s
        waited_for_room = False
        while True:
            started = time.monotonic()
            try:
                result = await attempt()
            except OUTAGE_ERRORS as err:
                left = self._lost(err, started)
                if left <= 0:
                    raise
                await asyncio.sleep(min(delay, left))
                delay = min(2 * delay, self.max_delay_s)
                continue
            except OutOfMemoryError as err:
                if not _WAIT_FOR_ROOM.get():
                    raise
                self._full(err)
                waited_for_room = True
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.max_delay_s)
                continue
            if self._since is not None and started >= self._noticed:
                self._back()
            if waited_for_room and self._full_since is not None:
                self._room()
            return result

    def _full(self, err: BaseException) -> None:
        """Note a write refused for want of memory; say so at first and every minute."""
        now = time.monotonic()
        if self._full_since is None:
            self._full_since = self._full_said = now
            self.fulls += 1
            reason = str(err).rstrip(".") or type(err).__name__
            self.say(
                f"[{self.who}] Redis at {self.url} is full ({reason}): writes wait for room, "
                "which comes back as the trainer takes groups and trims the streams "
                "(--max-buffer-bytes keeps a run's groups below a bound)"
            )
        elif now - self._full_said >= FULL_SAY_EVERY_S:
            self._full_said = now
            self.say(
                f"[{self.who}] Redis at {self.url}: still full after "
                f"{now - self._full_since:.0f} s; writes still waiting for room"
            )

    def _room(self) -> None:
        assert self._full_since is not None
        lasted = time.monotonic() - self._full_since
        self._full_since = None
        self.say(f"[{self.who}] Redis at {self.url}: room again after {lasted:.1f} s")

    def _lost(self, err: BaseException, started: float) -> float:
        """Note a failed call; the seconds the outage may still last."""
        now = time.monotonic()
        if self._since is None:
            self._since = started if isinstance(err, (RedisTimeoutError, TimeoutError)) else now
            self._noticed = now
            reason = str(err).rstrip(".") or type(err).__name__
            self.say(
                f"[{self.who}] Redis at {self.url}: connection lost ({reason}); retrying for "
                f"up to {self.timeout_s:g} s"
            )
        left = self._since + self.timeout_s - now
        if left <= 0 and not self._gave_up:
            self._gave_up = True
            self.say(
                f"[{self.who}] Redis at {self.url}: still unreachable after {now - self._since:.1f}"
                f" s (--redis-outage-timeout {self.timeout_s:g}); giving up"
            )
        return left

    def _back(self) -> None:
        assert self._since is not None
        lasted = time.monotonic() - self._since
        self._since = None
        self._gave_up = False
        self.reconnects += 1
        self.say(f"[{self.who}] Redis at {self.url}: reconnected after {lasted:.1f} s")


class _CancelSafeWrites:
    """Mixed into redis-py's connection class: a write bounded by the socket timeout through
    `asyncio.timeout`, so a cancel that arrives as it ends is not lost (module docstring).
    redis-py then writes without its own bound (socket_timeout None for the write only; a
    connection serves one command at a time)."""

    socket_timeout: float | None

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        timeout = self.socket_timeout
        if not timeout or sys.version_info >= (3, 12):  # 3.12's wait_for keeps the cancel
            return await super().send_packed_command(command, check_health)  # type: ignore[misc]
        self.socket_timeout = None
        try:
            async with asyncio.timeout(timeout):
                await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except TimeoutError:  # ours: redis-py raises its own TimeoutError, not the builtin
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise RedisTimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = timeout


@functools.cache
def _cancel_safe(connection_class: type) -> type:
    return type(connection_class.__name__, (_CancelSafeWrites, connection_class), {})


def _print(line: str) -> None:
    print(line, flush=True)


class Client(aioredis.Redis):
    """The client `connect` returns: redis-py's, each command riding out outages (`outages`)."""

    outages: Outages

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        send = super().execute_command
        return await self.outages.call(lambda: send(*args, **options))


def outages_of(redis: aioredis.Redis) -> Outages:
    """The outage policy of a `Client`; for another client (tests make plain ones) a new one
    with the default timeout, so pipelines sent through it still ride out outages."""
    if isinstance(redis, Client):
        return redis.outages
    kw = redis.connection_pool.connection_kwargs
    return Outages(f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}")


async def eviction_warning(redis: aioredis.Redis) -> str | None:
    """What to say when Redis may evict keys at its `maxmemory`: an evicted stream loses its
    groups without a trace, and a full Redis under `noeviction` only makes writes wait (module
    docstring). None under noeviction, or when CONFIG cannot be asked (a managed Redis)."""
    try:
        found = await redis.config_get("maxmemory-policy")
    except (ResponseError, OSError, RedisError):
        return None
    policy = next(iter(found.values()), b"") if found else b""
    policy = policy.decode() if isinstance(policy, bytes) else str(policy)
    if not policy or policy == "noeviction":
        return None
    what = (
        "any key, the run's streams among them"
        if policy.startswith("allkeys")
        else ("keys with a TTL: heartbeats, the trainer's lease")
    )
    return (
        f"Redis has maxmemory-policy {policy}: at its maxmemory it evicts {what}, and a group "
        "whose entry is evicted is lost without a trace. Set it to noeviction (CONFIG SET "
        "maxmemory-policy noeviction, or in redis.conf): a full Redis then makes writes wait "
        "for room instead"
    )


def _one_fresh_try() -> Retry:
    """redis-py's own retry: one more try at once, on a new connection, for a connection
    that died while pooled (a restart Redis is back from); all else is `Outages`' job."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def redact(url: str) -> str:
    """The URL with any password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (
        f":{parts.port}" if parts.port else ""
    )
    return urlunsplit(parts._replace(netloc=netloc))


def password_for(url: str, password: str | None) -> str | None:
    """The password to send besides `url`: none when the URL has one (it wins), else
    `password` (--redis-password or --redis-password-file, resolved by the config), else
    REDIS_PASSWORD. Every Redis client of millstream, Celery's included, asks here."""
    if urlsplit(url).password is not None:
        return None
    return password or os.environ.get("REDIS_PASSWORD") or None


async def connect(
    url: str,
    password: str | None = None,
    timeout_s: float = 5.0,
    max_connections: int = 64,
    wait_s: float = 0.0,
    outage_timeout_s: float = OUTAGE_TIMEOUT_S,
    who: str = "millstream",
) -> Client:
    """An async client that has answered PING; ServiceUnavailable otherwise. `wait_s`: keep
    trying that long while Redis cannot be reached (refused, timed out, still loading its
    AOF after a restart). Later outages: `outage_timeout_s`, console lines named `who`
    (`Outages`; a worker sets both from the run config with `outages.configure`)."""
    password = password_for(url, password)

    def pool(**retries: object) -> aioredis.BlockingConnectionPool:
        # A blocking pool: a burst of concurrent jobs waits for a free connection instead of
        # failing with "Too many connections" (a worker runs up to --rollout-max-concurrency
        # jobs, each of which talks to Redis).
        made = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s * 6,
            password=password,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
            **retries,
        )
        made.connection_class = _cancel_safe(made.connection_class)
        return made

    try:
        probe = aioredis.Redis.from_pool(pool(retry=Retry(ExponentialBackoff(), 0)))
    except ValueError as err:
        raise ServiceUnavailable(f"bad Redis URL {redact(url)!r}: {err}") from None
    start = said = time.monotonic()
    try:
        while True:
            try:
                await probe.ping()
                break
            except (AuthenticationError, ResponseError) as err:
                raise ServiceUnavailable(
                    f"Redis at {redact(url)} refused us: {err} (check the password: in "
                    "--redis-url, --redis-password, --redis-password-file or REDIS_PASSWORD)"
                ) from None
            except (RedisError, OSError) as err:
                if time.monotonic() - start >= wait_s:
                    raise ServiceUnavailable(
                        f"cannot reach Redis at {redact(url)}: {str(err).rstrip('.')}. Is "
                        "redis-server running there? Without --redis-url, `millstream train` "
                        "starts its own."
                    ) from None
                if time.monotonic() - said >= 5.0:
                    said = time.monotonic()
                    log.warning(
                        "Redis at %s unreachable for %.0f s (%s); waiting up to %.0f s",
                        redact(url), said - start, err, wait_s,
                    )  # fmt: skip
                await asyncio.sleep(0.5)
    finally:
        await probe.aclose()
    redis = Client.from_pool(pool(retry=_one_fresh_try()))  # it owns (and closes) the pool
    redis.outages = Outages(url, outage_timeout_s, who)
    return redis
