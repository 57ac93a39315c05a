"""The resolved run config in Redis (`{run}:config`) and in the run dir, as JSON.

The trainer writes it once at start; rollout and reward workers, started with only
--redis-url and --run-id, read it back. JSON (not pickle) so `redis-cli get` shows it.

Invariant: no secret is written out. Workers bring their own Redis password, and none of
them calls an admin endpoint, so the published config has no Redis password (flag, file or
in the URL: there it reads `***`) and no admin token; the trainer alone talks to W&B, so
there is no --wandb-key either.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from ..errors import MillstreamError
from ..keys import RunKeys
from ..redis_conn import redact
from . import GROUPS, RunConfig
from .schema import from_dict, to_dict

SCHEMA_VERSION = 1


def without_secrets(cfg: RunConfig) -> RunConfig:
    """`cfg` as workers and the run dir may see it (module docstring)."""
    conn = cfg.connection
    url = conn.redis_url and redact(conn.redis_url)
    return dataclasses.replace(
        cfg,
        connection=dataclasses.replace(
            conn, redis_url=url, redis_password=None, redis_password_file=None
        ),
        service=dataclasses.replace(cfg.service, admin_token=None),
        logging=dataclasses.replace(cfg.logging, wandb_key=None),
    )


def dumps(cfg: RunConfig) -> str:
    doc = {"schema": SCHEMA_VERSION, "config": to_dict(without_secrets(cfg))}
    return json.dumps(doc, indent=1, sort_keys=True)


def loads(text: str | bytes) -> RunConfig:
    doc: dict[str, Any] = json.loads(text)
    if doc.get("schema") != SCHEMA_VERSION:
        raise MillstreamError(
            f"run config schema {doc.get('schema')} is not the {SCHEMA_VERSION} this millstream reads: "
            "trainer and workers must run the same version"
        )
    data = doc["config"]
    groups = {name: from_dict(cls, data[name]) for name, cls, _ in GROUPS}
    return RunConfig(mode=data["mode"], **groups)


async def publish(redis: Any, cfg: RunConfig) -> None:
    await redis.set(RunKeys(cfg.run_id).config, dumps(cfg))


def write_file(cfg: RunConfig, directory: str | Path) -> Path:
    path = Path(directory) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(cfg))
    tmp.replace(path)
    return path


async def load(redis: Any, run_id: str, wait_s: float = 0.0, on_wait: Any = None) -> RunConfig:
    """Read `{run}:config`, waiting up to wait_s for the trainer to publish it."""
    key = RunKeys(run_id).config
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        text = await redis.get(key)
        if text is not None:
            return loads(text)
        if time.monotonic() >= deadline:
            raise MillstreamError(
                f"no run config at Redis key {key!r}: start the trainer for run {run_id!r} first "
                "(it publishes the config), or check --run-id"
            )
        if on_wait and not announced:
            on_wait(f"waiting for the run config at {key!r} (the trainer publishes it)")
            announced = True
        await asyncio.sleep(0.2)
