"""The resolved config travels through Redis: workers start with only --redis-url and --run-id."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.common.config import parse_run_config
from millstream.common.config import store as config_store
from millstream.common.errors import MillstreamError, ServiceUnavailable
from millstream.common.redis_conn import connect
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration


def test_config_round_trip_through_redis(redis_url):
    cfg = parse_run_config(
        ["--run-id", "rt", "--rollout-batch-size", "3", "--n-samples-per-prompt", "4"], mode="async"
    )

    async def go():
        redis = await connect(redis_url)
        try:
            await config_store.publish(redis, cfg)
            return await config_store.load(redis, "rt")
        finally:
            await redis.aclose()

    assert asyncio.run(go()) == cfg


def test_missing_config_is_a_clear_error(redis_url):
    async def go():
        redis = await connect(redis_url)
        try:
            await config_store.load(redis, "nobody", wait_s=0.3)
        finally:
            await redis.aclose()

    with pytest.raises(MillstreamError, match="nobody:config"):
        asyncio.run(go())


def test_unreachable_redis_names_the_url_without_password():
    url = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(ServiceUnavailable) as err:
        asyncio.run(connect(url, timeout_s=1))
    assert f"127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}" in str(err.value)
    assert "s3cret" not in str(err.value)


def test_trainer_cli_with_unreachable_redis_exits_1_without_traceback(tmp_path):
    """It waits --redis-outage-timeout for a Redis that may start after it, then fails."""
    arith = Path(__file__).resolve().parents[2] / "examples" / "arith"  # passes the preflight
    proc = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "train", "--redis-url", f"redis://127.0.0.1:{free_port()}",
         "--redis-outage-timeout", "1",
         "--router-url", "http://127.0.0.1:9", "--hf-checkpoint", str(arith / "model"),
         "--prompt-data", str(arith / "data" / "train.jsonl"), "--input-key", "prompt",
         "--rm-type", "math", "--num-rollout", "1", "--n-samples-per-prompt", "2",
         "--rollout-batch-size", "2", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "cannot reach Redis at redis://127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_password_protected_redis(tmp_path):
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path, password="pw")
    try:
        bare = server.url.replace(":pw@", "")
        with pytest.raises(ServiceUnavailable, match="refused"):
            asyncio.run(connect(bare))

        async def ok():
            redis = await connect(bare, password="pw")
            await redis.aclose()

        asyncio.run(ok())
    finally:
        server.stop()
