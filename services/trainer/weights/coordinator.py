"""The Coordinator gRPC service, hosted by trainer rank 0 (`--coordinator-port`, 0: a free one).

    GetVersion()              -> VersionInfo{version, updated_unix, run_id}
    WatchVersion(after)       => the current version at once when it is > after (-1: always),
                                 then every version the trainer publishes, in order
    JoinEngine(engine_url)    -> {accepted, version, message}: the engine is recorded as a
                                 pending join; the trainer takes it at its next weight sync
                                 (`take_pending_joins`), which adds it to the router and
                                 pushes the weights to it

What it owns: the published policy version V (the number of weight syncs done) and the
pending joins. Invariants: V never goes down; every watcher sees every published version
once, in order (one queue per watcher); when a Redis client is given, `{run}:version` holds
V after each publish (writes are serialised and always write the latest V, so the key never
goes back). An engine that joins gets no traffic before it has the current weights: the
router routes only to engines reporting the version it serves (version-gated routing), and
the sync moves that version. Each RPC runs in a server span whose parent is the caller's
trace context from the gRPC metadata.

Admin token (`admin_token`, the trainer's --admin-token): JoinEngine, which puts an engine
in the weight sync and so in routing, needs the metadata `authorization: Bearer <token>` when
one is set, the scheme of the router's admin endpoints (common/auth.py); UNAUTHENTICATED
otherwise, and nothing is recorded. GetVersion and WatchVersion only read, and stay open.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
from opentelemetry.trace import SpanKind

from millstream.common import telemetry
from millstream.common.auth import refusal
from millstream.common.errors import MillstreamError
from millstream.common.keys import RunKeys
from millstream.common.pb import services_pb2, services_pb2_grpc

log = logging.getLogger("millstream.trainer")


def host_address() -> str:
    """This host's address as other hosts (containers) on its network see it."""
    return socket.gethostbyname(socket.gethostname())


class Coordinator(services_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        run_id: str,
        *,
        version: int = 0,
        redis: Any = None,
        tracer: Any = None,
        admin_token: str | None = None,
    ):
        self.run_id = run_id
        self._admin_token = admin_token
        self._info = services_pb2.VersionInfo(
            version=version, updated_unix=time.time(), run_id=run_id
        )
        self._redis = redis
        self._key = RunKeys(run_id).version
        self._tracer = tracer or telemetry.tracer("millstream.trainer")
        self._watchers: set[asyncio.Queue[services_pb2.VersionInfo]] = set()
        self._pending: dict[str, float] = {}  # engine url -> when it asked, in arrival order
        self._write_lock: asyncio.Lock | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None
        self.address: str | None = None  # host:port engines reach it at (`advertise`)

    @property
    def version(self) -> int:
        return self._info.version

    # -- the trainer's side -------------------------------------------------------------

    def publish_version(self, version: int) -> asyncio.Task[None] | None:
        """Make `version` current and tell every watcher. With Redis, the write runs as a task,
        returned so a caller may await it (stop() awaits the ones left)."""
        if version < self._info.version:
            raise ValueError(
                f"version {version} < current {self._info.version}: it never goes down"
            )
        changed = version != self._info.version
        self._info = services_pb2.VersionInfo(
            version=version, updated_unix=time.time(), run_id=self.run_id
        )
        if changed:
            for queue in self._watchers:
                queue.put_nowait(self._info)
        if self._redis is None:
            return None
        task = asyncio.get_running_loop().create_task(self._write_version())
        self._writes.add(task)
        task.add_done_callback(self._write_done)
        return task

    def _write_done(self, task: asyncio.Task[None]) -> None:
        self._writes.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "coordinator: writing version %d to Redis %s failed: %r",
                self._info.version, self._key, task.exception(),
            )  # fmt: skip

    async def _write_version(self) -> None:
        if self._write_lock is None:
            self._write_lock = asyncio.Lock()
        async with self._write_lock:
            await self._redis.set(self._key, self._info.version)

    def take_pending_joins(self) -> list[str]:
        """The engines that asked to join since the last call, oldest first."""
        urls, self._pending = list(self._pending), {}
        return urls

    # -- the RPCs -------------------------------------------------------------------------

    def _span(self, name: str, context: grpc.aio.ServicerContext) -> Any:
        return telemetry.rpc_server_span(
            self._tracer, "Coordinator", name, context.invocation_metadata()
        )

    async def _check_token(self, context: grpc.aio.ServicerContext) -> None:
        given = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        why = refusal(str(given[0]) if given else None, self._admin_token)
        if why:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{why} in the gRPC metadata `authorization` (the engine's --admin-token "
                "must be the trainer's)",
            )

    async def GetVersion(
        self, request: services_pb2.GetVersionRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.VersionInfo:
        with self._span("GetVersion", context):
            return self._info

    async def WatchVersion(
        self, request: services_pb2.WatchVersionRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[services_pb2.VersionInfo]:
        # A plain span, ended in `finally`: a stream outlives many yields, and attaching a
        # context across them would be detached out of order when the stream is cancelled.
        parent = telemetry.context_from_grpc_metadata(context.invocation_metadata())
        span = self._tracer.start_span(
            "millstream.v1.Coordinator/WatchVersion",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                **telemetry.rpc_attributes("Coordinator", "WatchVersion"),
                "millstream.after_version": request.after_version,
            },
        )
        queue: asyncio.Queue[services_pb2.VersionInfo] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            last = request.after_version
            if self._info.version > last:
                queue.put_nowait(self._info)
            while True:
                info = await queue.get()
                if info.version > last:
                    last = info.version
                    span.add_event("version", {"version": info.version})
                    yield info
        finally:
            self._watchers.discard(queue)
            span.end()

    async def JoinEngine(
        self, request: services_pb2.JoinEngineRequest, context: grpc.aio.ServicerContext
    ) -> services_pb2.JoinEngineResponse:
        with self._span("JoinEngine", context) as span:
            await self._check_token(context)
            url = request.engine_url.strip().rstrip("/")
            span.set_attribute("engine_url", url)
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"engine_url: {request.engine_url!r} is not an http(s)://host:port URL",
                )
            self._pending.setdefault(url, time.time())
            version = self._info.version
            log.info("engine %s asked to join; it gets the weights at the next sync", url)
            return services_pb2.JoinEngineResponse(
                accepted=True,
                version=version,
                message=(
                    f"{url} joins at the trainer's next weight sync (current version {version}); "
                    "the router sends it traffic once it serves the router's version"
                ),
            )

    # -- serving --------------------------------------------------------------------------

    async def start(self, port: int = 0, host: str = "[::]") -> int:
        """Serve on `port` (0: a free one); returns the bound port."""
        server = grpc.aio.server()
        services_pb2_grpc.add_CoordinatorServicer_to_server(self, server)
        try:
            bound = server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise MillstreamError(
                f"cannot serve gRPC Coordinator on {host}:{port}: port in use? "
                "(--coordinator-port, 0 picks a free one)"
            )
        await server.start()
        self._server = server
        log.info(
            "coordinator: gRPC on port %d (run %s, version %d)", bound, self.run_id, self.version
        )
        return bound

    async def advertise(self, redis: Any, port: int, host: str | None = None) -> str:
        """Publish where engines reach this service ({run}:coordinator = host:port): `host`,
        else this host's address as other hosts see it, and the port from --coordinator-port
        (it listens on every interface)."""
        address = self.address = f"{host or host_address()}:{port}"
        if redis is not None:
            await redis.set(RunKeys(self.run_id).coordinator, address)
        return address

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (watch streams end) and finish the pending Redis writes."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
