"""Flags of `millstream reward` and `millstream reward-celery`: where the run is, nothing more.

Reward workers start with only --redis-url and --run-id (docs/architecture.md); everything
about scoring (--rm-type, --custom-rm-path, timeouts, executor, filter, claim/dead-letter
policy) comes from the run config the trainer published at `{run}:config`. The few flags
here are about this process: the Redis password when not in the URL (--redis-password,
--redis-password-file or REDIS_PASSWORD), its gRPC and metrics ports, consumer name, logs and
traces.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from millstream.common.config.errors import ConfigError
from millstream.common.config.schema import add_group, flag, from_namespace
from millstream.common.config.service import (
    METRICS_PORT_HELP,
    PASSWORD_FILE_HELP,
    check_metrics_port,
    redis_password,
)

LOG_LEVELS = ("debug", "info", "warning", "error")


def _check_run_id(run_id: str) -> None:
    # Same rule as the trainer's --run-id: it prefixes every Redis key of the run.
    if not run_id or any(c in run_id for c in " :{}"):
        raise ConfigError(
            f"--run-id must be non-empty without spaces, ':' or braces (got {run_id!r})"
        )


@dataclass(frozen=True)
class RewardWorkerConfig:
    redis_url: str = flag("redis://127.0.0.1:6379/0", "Redis of the run (redis://host:port/db)")
    run_id: str = flag("millstream", "run id the trainer published its config under")
    redis_password: str | None = flag(
        None, "Redis password, when not in the URL (or REDIS_PASSWORD)"
    )
    redis_password_file: str | None = flag(None, PASSWORD_FILE_HELP)
    grpc_port: int | None = flag(
        None, "serve gRPC Reward.Score on this port (0: pick a free one); none: no gRPC"
    )
    consumer_name: str | None = flag(
        None, "this worker's consumer name in group `reward` (default reward-HOST-PID)"
    )
    log_level: str = flag("info", "", choices=LOG_LEVELS)
    run_dir: str | None = flag(None, "traces go to RUN_DIR/traces (default: the run's run dir)")
    config_wait: float = flag(600.0, "seconds to wait for the trainer to publish the run config")
    metrics_port: int | None = flag(None, METRICS_PORT_HELP)

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        password = redis_password(self.redis_password, self.redis_password_file)
        object.__setattr__(self, "redis_password", password)
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"--grpc-port must be in 0..65535 (got {self.grpc_port})")
        check_metrics_port(self.metrics_port)
        if self.config_wait < 0:
            raise ConfigError(f"--config-wait must be >= 0 (got {self.config_wait})")


@dataclass(frozen=True)
class CeleryWorkerConfig:
    redis_url: str = flag("redis://127.0.0.1:6379/0", "Redis of the run: Celery broker and backend")
    run_id: str = flag("millstream", "run id the trainer published its config under")
    redis_password: str | None = flag(
        None, "Redis password, when not in the URL (or REDIS_PASSWORD)"
    )
    redis_password_file: str | None = flag(None, PASSWORD_FILE_HELP)
    pool: str = flag("threads", "Celery execution pool", choices=("threads", "solo"))
    concurrency: int = flag(4, "tasks run at once (threads pool)")
    log_level: str = flag("info", "", choices=LOG_LEVELS)
    config_wait: float = flag(600.0, "seconds to wait for the trainer to publish the run config")

    def __post_init__(self) -> None:
        _check_run_id(self.run_id)
        password = redis_password(self.redis_password, self.redis_password_file)
        object.__setattr__(self, "redis_password", password)
        if self.concurrency <= 0:
            raise ConfigError(f"--concurrency must be > 0 (got {self.concurrency})")


def _parse(cls: type, prog: str, description: str, argv: Sequence[str]) -> object:
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    add_group(parser, cls, "worker")
    ns = parser.parse_args(list(argv))
    try:
        return from_namespace(cls, ns)
    except ConfigError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def parse_worker_args(argv: Sequence[str]) -> RewardWorkerConfig:
    cfg = _parse(
        RewardWorkerConfig,
        "millstream reward",
        "Reward worker: {run}:generated -> {run}:scored. Scoring flags come from the run config.",
        argv,
    )
    assert isinstance(cfg, RewardWorkerConfig)
    return cfg


def parse_celery_args(argv: Sequence[str]) -> CeleryWorkerConfig:
    cfg = _parse(
        CeleryWorkerConfig,
        "millstream reward-celery",
        "Celery worker running the reward tasks of one run (--reward-executor celery).",
        argv,
    )
    assert isinstance(cfg, CeleryWorkerConfig)
    return cfg
