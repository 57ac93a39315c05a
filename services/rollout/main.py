"""`millstream rollout`: read the run config from Redis, then turn prompts into sample groups.

Thin entry: parse the worker flags, connect to Redis, wait for the run config the trainer
publishes, set up tracing, build the router client and the worker, serve Prometheus /metrics
with --metrics-port, run until SIGTERM/SIGINT (which drain in-flight groups), and close
everything in `finally`. No torch here: the worker talks to engines only through the router
over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from millstream.common import heap
from millstream.common.config import store
from millstream.common.prom import start_metrics
from millstream.common.redis_conn import WORKER_WAIT_S, connect, redact
from millstream.common.streams import default_consumer_name
from millstream.common.telemetry import setup_tracing, shutdown_tracing

from .client import RouterClient
from .config import WorkerArgs, parse_worker_args, router_url_for
from .worker import RolloutWorker

log = logging.getLogger("millstream.rollout")

CONFIG_WAIT_S = 600.0
"""A worker may start before the trainer (compose starts all at once)."""


async def serve(args: WorkerArgs) -> None:
    assert args.redis_url and args.run_id  # WorkerArgs checked both
    redis = await connect(args.redis_url, args.redis_password, wait_s=WORKER_WAIT_S)
    provider = client = metrics = None
    try:
        cfg = await store.load(redis, args.run_id, wait_s=CONFIG_WAIT_S, on_wait=log.info)
        provider = setup_tracing("rollout", args.run_dir or cfg.run_dir)
        router_url = router_url_for(args, cfg)
        client = RouterClient(router_url, max_concurrency=cfg.rollout.rollout_max_concurrency)
        name = args.consumer_name or default_consumer_name("rollout")
        worker = RolloutWorker(cfg, redis, client, name)
        if args.metrics_port is not None:
            metrics = start_metrics(
                "rollout", worker.metrics.registry, args.metrics_port, redis_url=args.redis_url,
                redis_password=args.redis_password, streams=[worker.keys.prompts],
            )  # fmt: skip
        worker.stream_worker.install_signal_handlers()
        heap.freeze_startup_heap()
        log.info(
            "rollout worker %s: run %r on %s, router %s, partial rollout %s",
            name,
            cfg.run_id,
            redact(args.redis_url),
            router_url,
            "on" if cfg.rollout.partial_rollout else "off",
        )
        await worker.run()
    finally:
        if metrics is not None:
            metrics.close()
        if client is not None:
            await client.aclose()
        await redis.aclose()
        shutdown_tracing(provider)


def main(argv: Sequence[str]) -> int:
    args = parse_worker_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    asyncio.run(serve(args))
    return 0
