"""Connect to Redis once, with a clear error naming the URL (never the password)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError, ResponseError

from .errors import ServiceUnavailable


def redact(url: str) -> str:
    """The URL with any password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (
        f":{parts.port}" if parts.port else ""
    )
    return urlunsplit(parts._replace(netloc=netloc))


async def connect(
    url: str, password: str | None = None, timeout_s: float = 5.0, max_connections: int = 64
) -> aioredis.Redis:
    """An async client that has answered PING; ServiceUnavailable otherwise."""
    password = password or os.environ.get("REDIS_PASSWORD") or None
    try:
        # A blocking pool: a burst of concurrent jobs waits for a free connection instead of
        # failing with "Too many connections" (a worker runs up to --rollout-max-concurrency
        # jobs, each of which talks to Redis).
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s * 6,
            password=password if urlsplit(url).password is None else None,
            socket_connect_timeout=timeout_s,
            health_check_interval=30,
        )
        client = aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool
    except ValueError as err:
        raise ServiceUnavailable(f"bad Redis URL {redact(url)!r}: {err}") from None
    try:
        await client.ping()
    except (AuthenticationError, ResponseError) as err:
        await client.aclose()
        raise ServiceUnavailable(
            f"Redis at {redact(url)} refused us: {err} (check --redis-password)"
        ) from None
    except (RedisError, OSError) as err:
        await client.aclose()
        raise ServiceUnavailable(
            f"cannot reach Redis at {redact(url)}: {str(err).rstrip('.')}. Is redis-server running there? "
            "Without --redis-url, `millstream train` starts its own."
        ) from None
    return client
