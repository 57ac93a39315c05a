"""`millstream engine`: parse flags, set up tracing, load the model, serve, clean up.

Shutdown (SIGTERM or Ctrl-C): in-flight requests are aborted at once (their callers get
finish_reason abort, not a dropped connection), uvicorn drains, the engine withdraws from
its router, the scheduler thread stops, traces are flushed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Sequence
from typing import Any

from .config import EngineConfig, parse_engine_config

log = logging.getLogger("millstream.engine")


def advertised_url(config: EngineConfig) -> str:
    """The URL a router should use: a wildcard bind address is not reachable as such."""
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"http://{host}:{config.port}"


async def _serve(core: Any, config: EngineConfig) -> None:
    import uvicorn

    from .http.api import create_app
    from .http.registration import join, register, unregister

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            core.scheduler.abort(abort_all=True)
            super().handle_exit(sig, frame)

    uv_config = uvicorn.Config(
        create_app(core),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = Server(uv_config)
    serving = asyncio.create_task(server.serve())
    url = advertised_url(config)
    registered = False
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            log.info("engine serving %s at %s", config.model_path, url)
        if config.coordinator and server.started:
            try:
                await join(config.coordinator, url, config.admin_token)
            except Exception:
                server.should_exit = True
                await serving
                raise
            registered = bool(config.register_with)  # removed from that router on exit
        elif config.register_with and server.started:
            try:
                await register(config.register_with, url, config.admin_token, attempts=10)
                registered = True
            except Exception:
                server.should_exit = True
                await serving
                raise
        await serving
    finally:
        if registered and config.register_with:
            await unregister(config.register_with, url, config.admin_token)


def main(argv: Sequence[str]) -> int:
    config = parse_engine_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from millstream.common import heap, threads
    from millstream.common.telemetry import setup_tracing, shutdown_tracing

    os.environ.update(threads.spin_env())  # before torch loads libgomp, which reads it
    from .core import EngineCore

    print(f"[engine] {threads.apply(config.num_threads)} compute thread(s)", flush=True)
    heap.keep_freed_memory()  # decode steps reuse their memory (common/heap.py)

    provider = setup_tracing("engine", config.run_dir)
    core = None
    try:
        core = EngineCore(config)
        core.start()
        heap.freeze_startup_heap()
        # uvicorn re-raises the signal that stopped it once it is done; with the default
        # SIGTERM action that would kill us before the cleanup below. Installed only now, so a
        # SIGTERM while the model loads still ends the process at once.
        signal.signal(signal.SIGTERM, lambda *_: None)
        asyncio.run(_serve(core, config))
    finally:
        if core is not None:
            core.stop()
        shutdown_tracing(provider)
    return 0
