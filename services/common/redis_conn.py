"""Connect to Redis once, with a clear error naming the URL (never the password).

The client rides out a Redis restart: a command that meets a dropped connection is sent
again on a new one, with exponential backoff, for about `RECONNECT_BUDGET_S` seconds
(`RECONNECT`), before its error reaches the caller. Commands may therefore run twice when
a reply was lost; every write millstream makes is safe to repeat (XADD duplicates are
dropped by group id downstream, hand-offs are guarded scripts, XACK is idempotent).
The first PING is not retried unless the caller asks to wait (`wait_s`: a stream worker,
which may start during a Redis restart and has nothing to do without it): a wrong URL given
to the trainer fails at once; a wrong password always does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .errors import ServiceUnavailable

log = logging.getLogger(__name__)

WORKER_WAIT_S = 60.0
"""How long a stream worker starting up waits for Redis to be reachable (a restart of Redis
while a worker is replaced, as in the chaos tests, must not kill the new worker)."""

RECONNECT_RETRIES = 4
RECONNECT_BUDGET_S = 9.0
"""redis-py retries a command, and inside each try its reconnect, with the same policy: 5
tries of the command, each with up to 5 connects 0.1, 0.2, 0.4, 0.8 s apart, about 9 s in
all before a command fails: a restart of a few seconds goes unnoticed."""


def _reconnect() -> Retry:
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), RECONNECT_RETRIES)


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
) -> aioredis.Redis:
    """An async client that has answered PING; ServiceUnavailable otherwise. `wait_s`: keep
    trying that long while Redis cannot be reached (refused, timed out, still loading its
    AOF after a restart)."""
    password = password_for(url, password)

    def client(**retries: object) -> aioredis.Redis:
        # A blocking pool: a burst of concurrent jobs waits for a free connection instead of
        # failing with "Too many connections" (a worker runs up to --rollout-max-concurrency
        # jobs, each of which talks to Redis).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s * 6,
            password=password,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
            **retries,
        )
        return aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool

    try:
        probe = client(retry=Retry(ExponentialBackoff(), 0))
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
    return client(
        retry=_reconnect(), retry_on_error=[RedisConnectionError, RedisTimeoutError, OSError]
    )
