"""Real reward-service processes for integration tests, and stream helpers around them.

`RewardProcs` starts `python -m millstream.cli reward ...` / `reward-celery ...` from the repo
root (so `tests.support.reward_plugins` imports), logs each to a file, and stops whatever is
still running at the end. `publish_groups` / `collect_scored` talk to the run's streams.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from millstream.common.config import RunConfig
from millstream.common.config import store as config_store
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect
from millstream.common.streams import publish
from millstream.common.types import SampleGroup, ScoredGroup
from tests.support.worker_procs import WorkerProcs


class RewardProcs(WorkerProcs):
    def reward(self, name: str, *extra: str) -> subprocess.Popen:
        """A reward worker with consumer name `name` (traces under the log dir)."""
        flags = ["--consumer-name", name, "--run-dir", str(self.log_dir), "--log-level", "info"]
        return self.spawn("reward", name, [*flags, *extra])

    def celery(self, name: str, *extra: str) -> subprocess.Popen:
        return self.spawn("reward-celery", name, ["--log-level", "warning", *extra])


async def publish_config(redis_url: str, cfg: RunConfig) -> None:
    redis = await connect(redis_url)
    try:
        await config_store.publish(redis, cfg)
    finally:
        await redis.aclose()


async def publish_groups(
    redis: aioredis.Redis, run_id: str, groups: Sequence[SampleGroup], trace_fields=None
) -> None:
    for group in groups:
        await publish(redis, RunKeys(run_id).generated, group, trace_fields)


async def collect_scored(
    redis: aioredis.Redis, run_id: str, n: int, timeout_s: float
) -> list[tuple[ScoredGroup, dict[bytes, bytes]]]:
    """Read `{run}:scored` from the start until n entries are there (or the timeout); returns
    every entry seen by then, so a test can also catch duplicates."""
    stream = RunKeys(run_id).scored
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and await redis.xlen(stream) < n:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # anything extra (a duplicate) would show up now
    return [
        (ScoredGroup.FromString(fields[b"data"]), fields)
        for _id, fields in await redis.xrange(stream)
    ]
