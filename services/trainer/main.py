"""`millstream train` / `millstream train-async`.

For now (the foundation issue) this parses and validates every flag, publishes the resolved
config to Redis when --redis-url is given, and writes it to the run dir. The training loop
lands with the trainer issue.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from millstream.common.config import RunConfig, parse_run_config
from millstream.common.config import store as config_store
from millstream.common.redis_conn import connect, redact


async def _publish(cfg: RunConfig) -> None:
    assert cfg.connection.redis_url
    redis = await connect(cfg.connection.redis_url, cfg.connection.redis_password)
    try:
        await config_store.publish(redis, cfg)
    finally:
        await redis.aclose()


def _run(argv: Sequence[str], mode: str, prog: str) -> int:
    cfg = parse_run_config(argv, mode=mode, prog=prog)
    r = cfg.rollout
    print(
        f"[trainer] {cfg.mode} run {cfg.run_id!r}: rollout_batch_size={r.rollout_batch_size} "
        f"n_samples_per_prompt={r.n_samples_per_prompt} global_batch_size={r.global_batch_size} "
        f"num_steps_per_rollout={r.num_steps_per_rollout} max_staleness={cfg.max_staleness}"
    )
    path = config_store.write_file(cfg, cfg.run_dir)
    print(f"[trainer] resolved config written to {path}")
    if cfg.connection.redis_url:
        asyncio.run(_publish(cfg))
        print(
            f"[trainer] resolved config published to {redact(cfg.connection.redis_url)} as {cfg.run_id}:config"
        )
    print("[trainer] the training loop is not built yet (trainer issue); flags are valid")
    return 0


def train(argv: Sequence[str]) -> int:
    return _run(argv, "sync", "millstream train")


def train_async(argv: Sequence[str]) -> int:
    return _run(argv, "async", "millstream train-async")
