"""Real reward-service processes for integration tests, and stream helpers around them.

`RewardProcs` starts `python -m millstream.cli reward ...` / `reward-celery ...` from the repo
root (so `tests.support.reward_plugins` imports), logs each to a file, and stops whatever is
still running at the end. `publish_groups` / `collect_scored` talk to the run's streams.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import redis.asyncio as aioredis

from millstream.common.config import RunConfig
from millstream.common.config import store as config_store
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect
from millstream.common.streams import publish
from millstream.common.types import SampleGroup, ScoredGroup

ROOT = Path(__file__).resolve().parents[2]


class RewardProcs:
    def __init__(self, redis_url: str, run_id: str, log_dir: Path):
        self.redis_url = redis_url
        self.run_id = run_id
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def _start(self, command: str, name: str, extra: Sequence[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        argv = [sys.executable, "-m", "millstream.cli", command]
        argv += ["--redis-url", self.redis_url, "--run-id", self.run_id, *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.procs[name] = proc
        return proc

    def reward(self, name: str, *extra: str) -> subprocess.Popen:
        """A reward worker with consumer name `name` (traces under the log dir)."""
        flags = ["--consumer-name", name, "--run-dir", str(self.log_dir), "--log-level", "info"]
        return self._start("reward", name, [*flags, *extra])

    def celery(self, name: str, *extra: str) -> subprocess.Popen:
        return self._start("reward-celery", name, ["--log-level", "warning", *extra])

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def wait_for_log(self, name: str, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log(name):
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited early:\n{self.log(name)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} never logged {text!r}:\n{self.log(name)}")
            time.sleep(0.05)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name} ignored signal {sig}:\n{self.log(name)}") from None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


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
