"""Keeps a long run's Redis bounded while it goes (docs/architecture.md: streams are trimmed).

Every `interval_s` the trainer's janitor trims each stream of the run (prompts, generated,
scored, dead) below the oldest entry any of its consumer groups still needs (`trim_safely`),
and deletes the consumers that left: no pending entry, idle for `consumer_idle_ms`
(`delete_idle_consumers`). Both are atomic Lua scripts, so a worker reading meanwhile loses
nothing. Its calls ride out a Redis outage as every call of the trainer's client does
(`redis_conn.Outages`); a round that failed anyway (past --redis-outage-timeout) is logged and
tried again next round.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from millstream.common.keys import RunKeys
from millstream.common.streams import delete_idle_consumers, trim_safely

log = logging.getLogger(__name__)


@dataclass
class Tidied:
    """What the janitor removed so far."""

    entries: int = 0
    consumers: int = 0
    rounds: int = 0


def run_streams(keys: RunKeys) -> tuple[str, ...]:
    return (keys.prompts, keys.generated, keys.scored, keys.dead)


async def tidy(redis: Any, keys: RunKeys, consumer_idle_ms: int, into: Tidied) -> None:
    """One round over every stream of the run."""
    for stream in run_streams(keys):
        into.entries += await trim_safely(redis, stream)
        into.consumers += await delete_idle_consumers(redis, stream, consumer_idle_ms)
    into.rounds += 1


async def run_janitor(
    redis: Any, keys: RunKeys, *, interval_s: float, consumer_idle_ms: int, tidied: Tidied
) -> None:
    """`tidy` every interval, forever (cancel to stop)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await tidy(redis, keys, consumer_idle_ms, tidied)
        except (RedisError, OSError) as err:
            log.warning("janitor: this round failed (%s); trying again in %.0f s", err, interval_s)
