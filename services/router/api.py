"""The router's HTTP surface: registry and admin endpoints, /metrics, and the catch-all proxy.

Miles router compatible: `POST /add_worker` (url in `?url=` or a JSON body), `POST
/remove_worker`, `GET /list_workers` -> {"urls": [...]}. sglang-router compatible: `POST
/workers` -> 202 {"status": "accepted", "worker_id", ...}, `GET /workers` -> {"workers",
"total", "stats"}, `GET|DELETE /workers/{id}`. Version gating: `POST /set_weight_version`,
`GET /get_weight_version` (answered here, not proxied). Everything else goes to a worker;
SGLang's newer names `/server_info` and `/model_info` go to a worker's `/get_server_info` and
`/get_model_info`, which every SGLang release and millstream's engine answer (sglang-router
serves both names with one handler the same way).

Invariants: mutating endpoints need `Authorization: Bearer <admin token>` when one is set
(compared in constant time, common/auth.py), and so do the engines' admin paths the proxy
forwards (pause, weight updates, ...: proxy.py), whether or not the engine has a token; other
proxied traffic never does. The caller's Authorization header goes on to the engine, which
guards its own admin endpoints too. No body over --max-request-bytes is read (413,
common/http_limits.py). The router's own endpoints answer bad input with 4xx and a message
naming the field, never 5xx.

Every answer of the router's own endpoints carries `X-Millstream-Router: <id>`, an id drawn
at start: a client that sees it change knows the router restarted and forgot what it was
told (its workers, the weight version), which the trainer then tells it again
(trainer/weights/router_admin.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from opentelemetry import trace
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from millstream.common import telemetry
from millstream.common.auth import refusal
from millstream.common.fencing import FENCE_HEADER, FENCED, FenceGate
from millstream.common.http_limits import BodyLimit
from millstream.common.http_pool import make_client

from .config import RouterConfig, normalize_worker_url, parse_host_port
from .discovery import Discovery, Resolve, resolve_addresses
from .health import HealthChecker
from .metrics import CONTENT_TYPE, RouterMetrics
from .policies import make_policy
from .proxy import Proxy, error_response
from .registry import Registry, Worker

PROXY_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
WORKER_FIELDS = {"url", "worker_url"}
# sglang-router's worker spec fields we accept (and show in GET /workers) but do not act on.
SGLANG_WORKER_FIELDS = {"url", "worker_type", "model_id", "priority", "cost", "labels"}
ROUTER_ID_HEADER = "x-millstream-router"
log = logging.getLogger("millstream.router")
# SGLang's current name of a worker's info endpoint -> the name every worker answers.
WORKER_INFO_PATHS = {"/server_info": "/get_server_info", "/model_info": "/get_model_info"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Router:
    """The components of one router instance, wired together; `app.state.router`."""

    def __init__(
        self,
        cfg: RouterConfig,
        transport: httpx.AsyncBaseTransport | None = None,
        tracer: trace.Tracer | None = None,
        resolve: Resolve = resolve_addresses,
    ):
        self.cfg = cfg
        self.instance = secrets.token_hex(8)  # X-Millstream-Router: new at every start
        self.fences = FenceGate()  # a run's older trainer is refused (common/fencing.py)
        self.registry = Registry(cfg.health_failure_threshold, cfg.health_success_threshold)
        self.policy = make_policy(
            cfg.router_policy,
            cache_threshold=cfg.cache_threshold,
            balance_abs_threshold=cfg.balance_abs_threshold,
            balance_rel_threshold=cfg.balance_rel_threshold,
            max_tree_size=cfg.max_tree_size,
        )
        self.metrics = RouterMetrics(self.registry)
        timeout = httpx.Timeout(cfg.request_timeout, connect=min(5.0, cfg.request_timeout))
        self.client = make_client(timeout, transport)
        self.health = HealthChecker(
            self.registry, self.client, cfg.health_check_interval, cfg.health_check_timeout
        )
        self.proxy = Proxy(
            self.registry,
            self.policy,
            self.client,
            self.metrics,
            cfg.max_retries,
            tracer,
            version_wait_s=cfg.version_wait_timeout,
            admin_token=cfg.admin_token,
            fences=self.fences,
        )
        for url in cfg.worker_urls:
            self.registry.add(url)
        self.discovery: Discovery | None = None
        if cfg.discover_workers:
            self.discovery = Discovery(
                [parse_host_port(target) for target in cfg.discover_workers],
                cfg.discover_interval,
                cfg.health_check_timeout,
                registry=self.registry,
                add=self.add,
                remove=self.remove,
                answers=self.health.answers,
                resolve=resolve,
            )

    async def start(self) -> None:
        await self.health.check_all()  # admit reachable workers before the first request
        self.health.start()
        if self.discovery is not None:
            self.discovery.start()  # its first round at once, in the background

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        await self.client.aclose()

    async def add(self, url: str, info: dict | None = None) -> Worker:
        worker, created = self.registry.add(url, info)
        if created:
            await self.health.check(worker)  # so it serves as soon as this call returns
        return worker

    def remove(self, worker: Worker) -> None:
        self.registry.remove(worker.url)
        self.policy.forget(worker)

    def describe(self, w: Worker) -> dict[str, Any]:
        return {
            "id": w.id,
            "url": w.url,
            "worker_type": "regular",
            "connection_mode": "Http",
            "is_healthy": w.healthy,
            "health": w.status,
            "eligible": self.registry.is_eligible(w),
            "load": w.in_flight,
            "in_flight": w.in_flight,
            "served": w.served,
            "weight_version": w.weight_version,
            "consecutive_failures": w.consecutive_failures,
            "last_error": w.last_error,
            **w.info,
        }


async def _check_token(request: Request) -> None:
    """Every admin endpoint: the admin token, then the caller's fencing number."""
    router = request.app.state.router
    if why := refusal(request.headers.get("authorization"), router.cfg.admin_token):
        raise ApiError(401, why, "unauthorized")
    if why := router.fences.refusal(request.headers.get(FENCE_HEADER)):
        log.warning("router: refused %s %s: %s", request.method, request.url.path, why)
        raise ApiError(409, why, FENCED)


admin = Depends(_check_token)


async def _json_object(request: Request, allowed: set[str]) -> dict[str, Any]:
    """The JSON object body (empty body: {}); 400 naming the problem otherwise."""
    where = f"{request.method} {request.url.path}"
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise ApiError(400, f"{where}: body is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"{where}: body must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ApiError(
            400,
            f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}",
        )
    return data


def _url_from(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ApiError(400, f"field {field!r} must be a string URL, got {type(value).__name__}")
    try:
        return normalize_worker_url(value)
    except ValueError as err:
        raise ApiError(400, f"field {field!r}: {err}") from None


async def _miles_url(request: Request) -> str:
    """Miles' convention: `?url=` (or `?worker_url=`) or a JSON body with the same key."""
    unknown = sorted(set(request.query_params) - WORKER_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown query parameter(s) {', '.join(unknown)}; allowed: url")
    for field in ("url", "worker_url"):
        if field in request.query_params:
            return _url_from(request.query_params[field], field)
    body = await _json_object(request, WORKER_FIELDS)
    for field in ("url", "worker_url"):
        if field in body:
            return _url_from(body[field], field)
    raise ApiError(400, "field 'url' is required (use ?url=http://host:port or a JSON body)")


def _router(request: Request) -> Router:
    return request.app.state.router


def _miles_state(r: Router) -> dict[str, Any]:
    return {"status": "success", "worker_urls": {w.url: w.in_flight for w in r.registry.all()}}


def _find(r: Router, worker_id: str) -> Worker:
    worker = r.registry.by_id(worker_id)
    if worker is None:
        raise ApiError(404, f"worker {worker_id!r} not found", "not_found")
    return worker


async def add_worker(request: Request):
    r = _router(request)
    worker = await r.add(await _miles_url(request))
    return {**_miles_state(r), "worker_id": worker.id}


async def remove_worker(request: Request):
    r = _router(request)
    worker = r.registry.get(await _miles_url(request))
    if worker is not None:
        r.remove(worker)
    return _miles_state(r)


async def list_workers(request: Request):
    return {"urls": [w.url for w in _router(request).registry.all()]}


async def create_worker(request: Request):
    body = await _json_object(request, SGLANG_WORKER_FIELDS)
    if "url" not in body:
        raise ApiError(400, "field 'url' is required")
    if body.get("worker_type", "regular") != "regular":
        kind = body["worker_type"]
        raise ApiError(400, f"field 'worker_type': only 'regular' is supported, got {kind!r}")
    info = {k: v for k, v in body.items() if k not in ("url", "worker_type")}
    worker = await _router(request).add(_url_from(body["url"], "url"), info)
    location = f"/workers/{worker.id}"
    content = {
        "status": "accepted",
        "worker_id": worker.id,
        "url": worker.url,
        "location": location,
        "message": "Worker added",
    }
    return JSONResponse(content, status_code=202, headers={"location": location})


async def workers(request: Request):
    r = _router(request)
    listed = [r.describe(w) for w in r.registry.all()]
    stats = {"prefill_count": 0, "decode_count": 0, "regular_count": len(listed)}
    return {"workers": listed, "total": len(listed), "stats": stats}


async def worker(request: Request, worker_id: str):
    r = _router(request)
    return r.describe(_find(r, worker_id))


async def delete_worker(request: Request, worker_id: str):
    r = _router(request)
    r.remove(_find(r, worker_id))
    content = {"status": "accepted", "worker_id": worker_id, "message": "Worker removed"}
    return JSONResponse(content, status_code=202)


async def set_weight_version(request: Request):
    """Gate on a version. Every worker's version is read again before answering, except
    those in `workers_at_version`: the caller (the trainer, which just updated them and
    heard each one confirm the version) vouches for them, which saves the weight sync a
    round trip to each; the next health round reads them as usual. `"read_versions": false`
    reads none: the caller knows no worker holds the version yet (a weight sync about to
    ship it), so each keeps its last known version, and no request goes to it until it is
    vouched for or the next health round reads the new one."""
    body = await _json_object(request, {"weight_version", "workers_at_version", "read_versions"})
    if "weight_version" not in body:
        raise ApiError(400, "field 'weight_version' is required (a string, or null to stop gating)")
    version = body["weight_version"]
    if isinstance(version, bool) or not (version is None or isinstance(version, (str, int))):
        raise ApiError(400, f"field 'weight_version' must be a string or null, got {version!r}")
    vouched = body.get("workers_at_version", [])
    if not isinstance(vouched, list) or not all(isinstance(u, str) for u in vouched):
        raise ApiError(400, f"field 'workers_at_version' must be a list of urls, got {vouched!r}")
    r = _router(request)
    r.registry.set_expected_version(None if version is None else str(version))
    known = set()
    if version is not None:
        for url in vouched:
            worker = r.registry.get(url.rstrip("/"))
            if worker is not None and worker.healthy:
                r.registry.vouch(worker, str(version))
                known.add(worker.url)
    read = body.get("read_versions", True)
    if not isinstance(read, bool):
        raise ApiError(400, f"field 'read_versions' must be true or false, got {read!r}")
    if read:
        await asyncio.gather(*(r.health.check(w) for w in r.registry.all() if w.url not in known))
    eligible = [w.url for w in r.registry.eligible()]
    return {"weight_version": r.registry.expected_version, "eligible": eligible}


async def get_weight_version(request: Request):
    return {"weight_version": _router(request).registry.expected_version}


async def metrics(request: Request):
    return Response(_router(request).metrics.render(), media_type=CONTENT_TYPE)


async def liveness():
    return {"status": "ok"}


async def readiness(request: Request):
    r = _router(request)
    if eligible := r.registry.eligible():
        return {"status": "ready", "eligible": len(eligible)}
    return error_response(503, r.registry.why_none(), "service_unavailable")


async def proxy(request: Request) -> Response:
    return await _router(request).proxy.handle(request)


# (method, path, handler, needs the admin token)
ROUTES = (
    ("POST", "/add_worker", add_worker, True),
    ("POST", "/remove_worker", remove_worker, True),
    ("GET", "/list_workers", list_workers, False),
    ("POST", "/workers", create_worker, True),
    ("GET", "/workers", workers, False),
    ("GET", "/workers/{worker_id}", worker, False),
    ("DELETE", "/workers/{worker_id}", delete_worker, True),
    ("POST", "/set_weight_version", set_weight_version, True),
    ("GET", "/get_weight_version", get_weight_version, False),
    ("GET", "/metrics", metrics, False),
    ("GET", "/liveness", liveness, False),
    ("GET", "/readiness", readiness, False),
)


OWN_PATHS = frozenset(path for _, path, _, _ in ROUTES if "{" not in path)
OWN_PREFIXES = tuple(path.split("{")[0] for _, path, _, _ in ROUTES if "{" in path)


class ProxyFastPath:
    """ASGI middleware: proxied requests (any path the router does not answer itself) go
    straight to the proxy, past FastAPI's exception, exit-stack, routing and request layers,
    which were half of the router's CPU per /generate in a training run (py-spy). The
    router's own endpoints go through FastAPI as before."""

    def __init__(self, app: Any, router: Router):
        self.app, self.router = app, router
        self.stamp = (ROUTER_ID_HEADER.encode(), router.instance.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if path in OWN_PATHS or path.startswith(OWN_PREFIXES):
            await self.app(scope, receive, self._stamped(send))
            return
        if scope["method"] not in PROXY_METHODS:
            await self.app(scope, receive, send)
            return
        if (asked := WORKER_INFO_PATHS.get(path)) is not None:
            scope = {**scope, "path": asked, "raw_path": asked.encode()}
        response = await self.router.proxy.handle(Request(scope, receive))
        await response(scope, receive, send)

    def _stamped(self, send: Any) -> Any:
        """`send` with this router's id among the response headers (module docstring)."""

        async def stamped(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.stamp]}
            await send(message)

        return stamped


def _routes(app: FastAPI) -> None:
    for method, path, handler, needs_admin in ROUTES:
        deps = [admin] if needs_admin else []
        app.add_api_route(path, handler, methods=[method], dependencies=deps)
    # A plain Starlette route, registered last: the hot path skips FastAPI's dependency layer.
    app.router.routes.append(Route("/{path:path}", proxy, methods=PROXY_METHODS))


def build_app(
    cfg: RouterConfig,
    transport: httpx.AsyncBaseTransport | None = None,
    tracer: trace.Tracer | None = None,
    resolve: Resolve = resolve_addresses,
) -> FastAPI:
    """The router app; its lifespan runs the first health round, the health loop and, with
    --discover-workers, the discovery loop.

    `transport`, `tracer` and `resolve` default to real sockets, the process's tracer
    provider and the system resolver; tests pass their own.
    """
    router = Router(cfg, transport, tracer, resolve)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(
        title="millstream router",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        telemetry=telemetry.fastapi_telemetry(),  # type: ignore[arg-type]
    )
    app.state.router = router

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError):
        response = error_response(err.status, err.message, err.kind)
        if err.status == 401:
            response.headers["www-authenticate"] = "Bearer"
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, err: RequestValidationError):
        fields = ", ".join(".".join(str(p) for p in e.get("loc", ())) for e in err.errors())
        return error_response(
            400, f"invalid request: {fields}: {err.errors()}", "invalid_request_error"
        )

    _routes(app)
    app.add_middleware(ProxyFastPath, router=router)
    app.add_middleware(  # outermost: no layer reads a body before it is counted
        BodyLimit,
        max_bytes=cfg.max_request_bytes,
        error_response=lambda status, message: error_response(status, message, "request_too_large"),
        flag="--max-request-bytes",
    )
    return app
