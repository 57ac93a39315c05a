"""`millstream reward` and `millstream reward-celery`: thin entry points.

`main`: connect to Redis, read the run config the trainer published (waiting for it if need
be), build the scorer it describes, serve gRPC Reward.Score when --grpc-port is set and
Prometheus /metrics when --metrics-port is, and run the stream worker until SIGTERM/SIGINT
drains it; clean up in `finally`.
`celery_worker`: the same config, served as Celery tasks (`--reward-executor celery`).

Imports stay light (no torch, no Celery until asked for): see tests/unit/test_reward_imports.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from millstream.common import heap
from millstream.common.config import RunConfig
from millstream.common.config import store as config_store
from millstream.common.prom import start_metrics
from millstream.common.redis_conn import WORKER_WAIT_S, connect, redact
from millstream.common.streams import default_consumer_name
from millstream.common.telemetry import setup_tracing, shutdown_tracing

from .config import RewardWorkerConfig, parse_celery_args, parse_worker_args

log = logging.getLogger("millstream.reward")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # math-verify warns once that its signal-based timeouts are off: we time rewards out
    # ourselves (--reward-timeout), so the warning would only mislead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


async def load_run_config(
    redis_url: str, run_id: str, password: str | None, wait_s: float
) -> RunConfig:
    redis = await connect(redis_url, password, wait_s=WORKER_WAIT_S)
    try:
        return await config_store.load(
            redis, run_id, wait_s=wait_s, on_wait=lambda msg: log.info("%s", msg)
        )
    finally:
        await redis.aclose()


def needs_warm_up(cfg: RunConfig) -> bool:
    """Whether to import math-verify before serving. Not when the run's reward is an instant
    rule (`exact`, `f1`: no math): sympy's import is most of a worker's start-up CPU, spent
    while the engines load beside it. A sample whose metadata asks for a math rule then
    imports it on first use, in its thread (under a second, against --reward-timeout)."""
    from .rm_hub import INSTANT_RULES, split_rm_type

    r = cfg.reward
    return (
        bool(r.custom_rm_path) or not r.rm_type or split_rm_type(r.rm_type)[1] not in INSTANT_RULES
    )


async def serve(wc: RewardWorkerConfig) -> None:
    from .grpc_service import start_server
    from .math_utils import warm_up
    from .scorer import GroupScorer
    from .worker import RewardWorker, build_executor

    redis = await connect(wc.redis_url, wc.redis_password, wait_s=WORKER_WAIT_S)
    executor = server = provider = metrics = None
    try:
        cfg = await config_store.load(
            redis, wc.run_id, wait_s=wc.config_wait, on_wait=lambda msg: log.info("%s", msg)
        )
        provider = setup_tracing("reward", wc.run_dir or cfg.run_dir)
        executor = build_executor(cfg, wc.redis_url, wc.redis_password)
        scorer = GroupScorer(cfg, executor)
        if cfg.reward.reward_executor == "inline" and needs_warm_up(cfg):
            await asyncio.to_thread(warm_up)
        name = wc.consumer_name or default_consumer_name("reward")
        worker = RewardWorker(redis, cfg, scorer, name)
        if wc.metrics_port is not None:
            metrics = start_metrics(
                "reward", worker.metrics.registry, wc.metrics_port, redis_url=wc.redis_url,
                redis_password=wc.redis_password, streams=[worker.keys.generated],
            )  # fmt: skip
        if wc.grpc_port is not None:
            server, port = await start_server(scorer, wc.grpc_port)
            print(f"[reward] gRPC Reward.Score on port {port}", flush=True)
        log.info(
            "reward worker %s on %s, run %s: rm_type=%s custom_rm_path=%s executor=%s filter=%s",
            name,
            redact(wc.redis_url),
            cfg.run_id,
            cfg.reward.rm_type,
            cfg.reward.custom_rm_path,
            cfg.reward.reward_executor,
            cfg.rollout.dynamic_sampling_filter_path,
        )
        heap.freeze_startup_heap()
        await worker.run()
        log.info("reward worker %s: %s", name, dict(sorted(scorer.stats.items())))
    finally:
        if metrics is not None:
            metrics.close()
        if server is not None:
            await server.stop(grace=2)
        if executor is not None:
            await executor.aclose()
        await redis.aclose()
        shutdown_tracing(provider)


def main(argv: Sequence[str]) -> int:
    wc = parse_worker_args(argv)
    _setup_logging(wc.log_level)
    asyncio.run(serve(wc))
    return 0


def celery_worker(argv: Sequence[str]) -> int:
    from .celery_app import CeleryRuntime, make_celery_app, queue_name, register_tasks
    from .math_utils import warm_up

    cc = parse_celery_args(argv)
    _setup_logging(cc.log_level)
    cfg = asyncio.run(load_run_config(cc.redis_url, cc.run_id, cc.redis_password, cc.config_wait))
    if needs_warm_up(cfg):
        warm_up()
    app = make_celery_app(cc.redis_url, cfg.run_id, cc.redis_password)
    runtime = CeleryRuntime(cfg)
    register_tasks(app, runtime)
    provider = setup_tracing("reward-celery", cfg.run_dir)
    try:
        worker = app.Worker(
            hostname=f"reward-celery-{os.getpid()}@%h",
            pool_cls=cc.pool,
            concurrency=cc.concurrency,
            loglevel=cc.log_level.upper(),
            queues=[queue_name(cfg.run_id)],
            without_heartbeat=True,
            without_gossip=True,
            without_mingle=True,
            quiet=True,
        )
        print(
            f"[reward-celery] run {cfg.run_id}: queue {queue_name(cfg.run_id)}, "
            f"pool {cc.pool} x{cc.concurrency}",
            flush=True,
        )
        worker.start()
        return int(worker.exitcode or 0)
    finally:
        runtime.close()
        shutdown_tracing(provider)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
