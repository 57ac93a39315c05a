"""`millstream router`: parse flags, set up tracing, serve the app, clean up."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence

import uvicorn

from millstream.common import heap
from millstream.common.telemetry import setup_tracing, shutdown_tracing

from .api import build_app
from .config import parse_router_config


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame) -> None:
    raise _Terminated


def main(argv: Sequence[str]) -> int:
    cfg = parse_router_config(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    provider = setup_tracing("router", cfg.run_dir)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it with the handler it found:
    # with the default one the process would die there and skip the `finally` below.
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        app = build_app(cfg)
        heap.freeze_startup_heap()
        logging.getLogger("millstream.router").info(
            "router on http://%s:%d, policy %s, %d worker(s) from flags%s",
            cfg.host,
            cfg.port,
            cfg.router_policy,
            len(cfg.worker_urls),
            (
                f", discovering {' '.join(cfg.discover_workers)} every {cfg.discover_interval:g}s"
                if cfg.discover_workers
                else ""
            ),
        )
        config = uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level=cfg.log_level,
            access_log=cfg.log_level == "debug",
            timeout_keep_alive=30,
        )
        uvicorn.Server(config).run()
    except _Terminated:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutdown_tracing(provider)
    return 0
