"""Forward one request to a chosen worker, retrying on another when that is safe.

Owns the data path: body bytes, method, path and query go to the worker untouched (a JSON
body is never re-serialised, so meta_info reaches the caller exactly as the engine wrote it);
hop-by-hop headers are stripped in both directions; the caller's W3C trace context is
continued by a `router.proxy` span and injected into the forwarded request. A request that
serves several prompt groups names them in X-Millstream-Groups (common/telemetry.py): the span
links to each group's and records their ids, and the header goes on to the engine as it came.

Retry invariant: an attempt is retried on another worker (at most `max_retries` times,
untried workers first) only while nothing has reached the caller yet: after a refused or
broken connection, or a 5xx. A non-streaming body is read whole before the caller sees
anything, so a worker dying mid-request is retried; a streaming body (SSE, NDJSON, chunked)
is relayed chunk by chunk after its first chunk arrived, and an error after that aborts the
caller's connection rather than pretending the stream ended. A read timeout is not retried
(the worker may still be working on it): the caller gets 504.

No eligible worker: 503 at once, unless a version change is under way (a healthy worker
not yet confirmed at the expected weight version: the version was set ahead of the update,
or an engine rejoined and is being synced). Then the request waits for a worker to become
eligible, up to `version_wait_s`, instead of making its caller back off and retry; the wait
is the span's `millstream.router.wait_ms`.

Admin paths: a request for an engine's admin endpoint (common/auth.py ENGINE_ADMIN_PATHS:
pause, continue, abort, flush, the weight updates, memory release) needs the router's admin
token when the router has one, whether or not the engine behind has its own: 401 here, and
no worker sees it. The caller's Authorization header then goes on to the engine unchanged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import httpx
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from millstream.common import telemetry
from millstream.common.auth import is_engine_admin_path, refusal
from millstream.common.fencing import FENCE_HEADER, FENCED, FenceGate

from .metrics import NO_WORKER, RouterMetrics
from .policies import Policy, route_key
from .registry import Registry, Worker

log = logging.getLogger("millstream.router")

# RFC 9110 section 7.6.1, plus the non-standard Proxy-Connection.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by whoever sends the bytes next, or re-injected for our own span.
REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect", *telemetry.TRACE_FIELDS}
RESPONSE_DROP = HOP_BY_HOP | {"content-length", "date", "server"}
STREAMING_TYPES = ("text/event-stream", "application/x-ndjson", "application/jsonl")
WORKER_HEADER = "x-millstream-worker"


def strip_headers(
    headers: Iterable[tuple[str, str]], drop: frozenset[str] | set[str]
) -> list[tuple[str, str]]:
    """Headers minus `drop` and minus any header the Connection header names (RFC 9110)."""
    pairs = [(k.lower(), v) for k, v in headers]
    named = {
        token.strip().lower()
        for k, v in pairs
        if k == "connection"
        for token in v.split(",")
        if token.strip()
    }
    return [(k, v) for k, v in pairs if k not in drop and k not in named]


def forward_headers(request: Request, span: trace.Span) -> dict[str, str]:
    """The caller's end-to-end headers, plus X-Forwarded-For and our span's trace context."""
    headers = dict(strip_headers(request.headers.items(), REQUEST_DROP))
    # Bodies are relayed still encoded: never let the worker compress unasked.
    headers.setdefault("accept-encoding", "identity")
    if request.client is not None:
        forwarded = headers.get("x-forwarded-for")
        host = request.client.host
        headers["x-forwarded-for"] = f"{forwarded}, {host}" if forwarded else host
    return telemetry.inject_headers(headers, trace.set_span_in_context(span))


def is_streaming(response: httpx.Response) -> bool:
    content_type = response.headers.get("content-type", "").lower()
    if any(content_type.startswith(t) for t in STREAMING_TYPES):
        return True
    return (
        "content-length" not in response.headers
        and "chunked" in response.headers.get("transfer-encoding", "").lower()
    )


def error_response(status: int, message: str, kind: str, **extra: object) -> JSONResponse:
    """The router's own errors: `{"error": {"message", "type", "code", ...}}` (OpenAI's shape)."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status, **extra}}, status_code=status
    )


def _with_headers(response: Response, headers: list[tuple[str, str]]) -> Response:
    response.raw_headers.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers)
    return response


def _buffered(upstream: httpx.Response, content: bytes, headers: list[tuple[str, str]]) -> Response:
    """A whole body as the worker sent it (still encoded); HEAD keeps the worker's length."""
    response = Response(content, status_code=upstream.status_code)
    length = upstream.headers.get("content-length")
    if upstream.request.method == "HEAD" and length is not None:
        response.raw_headers = [(b"content-length", length.encode("latin-1"))]
    return _with_headers(response, headers)


class _RelayResponse(StreamingResponse):
    """A relayed stream that runs `cleanup` exactly once, however the relay ends: finished,
    failed, or the caller gone before the first chunk was sent."""

    def __init__(self, content: AsyncIterator[bytes], status_code: int, cleanup) -> None:
        super().__init__(content, status_code=status_code)  # no media type: the worker's
        self._cleanup = cleanup
        self._cleaned = False

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._cleaned:
                self._cleaned = True
                await self._cleanup()


@dataclass
class _Retry:
    reason: str
    error: str


class Proxy:
    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        max_retries: int,
        tracer: trace.Tracer | None = None,
        version_wait_s: float = 0.0,
        admin_token: str | None = None,
        fences: FenceGate | None = None,
    ):
        self.registry = registry
        self.admin_token = admin_token
        self.fences = fences
        self.version_wait_s = version_wait_s
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.max_retries = max_retries
        self._tracer = tracer or telemetry.tracer("millstream.router")

    def _route_key(self, body: bytes, content_type: str):
        if not self.policy.needs_key or not body:
            return None
        if "json" not in content_type and not body.lstrip().startswith(b"{"):
            return None
        try:
            return route_key(json.loads(body))
        except ValueError:
            return None  # the worker will reject it; the router forwards bytes as they are

    def _pick(self, tried: list[Worker], broken: set[str], key) -> Worker | None:
        eligible = self.registry.eligible()
        fresh = [w for w in eligible if w not in tried] if tried else eligible
        candidates = fresh or [w for w in eligible if w.id not in broken]
        return self.policy.choose(candidates, key) if candidates else None

    async def _wait_for_version(self, key, span: trace.Span) -> Worker | None:
        """No worker is eligible: while a version change is under way, wait for one."""
        if not self.registry.version_pending():
            return None
        start = time.monotonic()
        deadline, worker = start + self.version_wait_s, None
        while worker is None and self.registry.version_pending():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await self.registry.wait_for_change(left)
            worker = self._pick([], set(), key)
        span.set_attribute("millstream.router.wait_ms", (time.monotonic() - start) * 1e3)
        return worker

    def _refused(self, request: Request) -> Response | None:
        """A 401 for an engine admin path without the router's token (module docstring), a
        409 for one from a run's older trainer (common/fencing.py)."""
        if not is_engine_admin_path(request.url.path):
            return None
        if self.fences is not None and (
            why := self.fences.refusal(request.headers.get(FENCE_HEADER))
        ):
            log.warning("router: refused %s %s: %s", request.method, request.url.path, why)
            return error_response(409, why, FENCED)
        if self.admin_token is None:
            return None
        why = refusal(request.headers.get("authorization"), self.admin_token)
        if why is None:
            return None
        log.warning("router: refused %s %s: %s", request.method, request.url.path, why)
        response = error_response(401, why, "unauthorized")
        response.headers["www-authenticate"] = "Bearer"
        return response

    async def handle(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        start = time.perf_counter()
        body = await request.body()
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        target = raw_path.decode("latin-1")
        if request.url.query:
            target += "?" + request.url.query
        key = self._route_key(body, request.headers.get("content-type", ""))
        served, links = telemetry.served_groups(request.headers)
        span = self._tracer.start_span(
            "router.proxy",
            context=telemetry.context_from_headers(request.headers),
            kind=SpanKind.SERVER,
            links=links,
            attributes={
                telemetry.STAGE: "router",
                "http.request.method": request.method,
                "url.path": request.url.path,
                **served,
            },
        )
        headers = forward_headers(request, span)

        tried: list[Worker] = []
        broken: set[str] = set()
        errors: list[str] = []
        failed: tuple[str, str] | None = None  # (worker, reason) of the last failed attempt
        fallback: tuple[str, Response] | None = None  # the last 5xx, passed on if all fail
        for _ in range(1 + self.max_retries):
            worker = self._pick(tried, broken, key)
            if worker is None and not tried:
                worker = await self._wait_for_version(key, span)
            if worker is None:
                break
            if failed is not None:
                self.metrics.retries.labels(*failed).inc()
            tried.append(worker)
            outcome = await self._attempt(
                worker, request.method, target, headers, body, span, start
            )
            if isinstance(outcome, Response):
                return outcome
            if isinstance(outcome, tuple):
                retry, response = outcome
                fallback = (worker.url, response)
            else:
                retry = outcome
                broken.add(worker.id)
            failed = (worker.url, retry.reason)
            errors.append(f"{worker.url}: {retry.error}")
            log.warning(
                "router: %s %s failed on %s (%s)", request.method, target, worker.url, retry.error
            )

        if fallback is not None:
            label, response = fallback
        elif tried:
            label = NO_WORKER
            message = f"all {len(tried)} attempts failed: " + "; ".join(errors)
            response = error_response(502, message, "bad_gateway")
        else:
            label = NO_WORKER
            response = error_response(503, self.registry.why_none(), "service_unavailable")
        self._finish(span, start, label, response.status_code, len(tried))
        return response

    async def _attempt(
        self,
        worker: Worker,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
        span: trace.Span,
        start: float,
    ) -> Response | _Retry | tuple[_Retry, Response]:
        self.registry.begin(worker)
        upstream: httpx.Response | None = None
        handed_off = False  # a relayed stream closes upstream and ends the request itself
        try:
            req = self.client.build_request(
                method, worker.url + target, headers=headers, content=body
            )
            try:
                upstream = await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                self.registry.record_failure(worker, f"connect failed: {err!r}")
                return _Retry("connect", f"connect failed ({type(err).__name__})")
            except httpx.TimeoutException as err:
                return self._timeout(worker, err, span, start)
            except httpx.TransportError as err:
                self.registry.record_failure(worker, f"connection broken: {err!r}")
                return _Retry("transport", f"connection broken ({type(err).__name__}: {err})")

            out_headers = strip_headers(upstream.headers.multi_items(), RESPONSE_DROP)
            out_headers.append((WORKER_HEADER, worker.url))
            if upstream.status_code < 500 and is_streaming(upstream):
                outcome = await self._relay(worker, upstream, out_headers, span, start)
                handed_off = isinstance(outcome, _RelayResponse)
                return outcome
            try:
                content = b"".join([chunk async for chunk in upstream.aiter_raw()])
            except httpx.TimeoutException as err:
                return self._timeout(worker, err, span, start)
            except httpx.TransportError as err:
                self.registry.record_failure(worker, f"connection broken: {err!r}")
                return _Retry("transport", f"connection broken mid-response ({type(err).__name__})")
            response = _buffered(upstream, content, out_headers)
            if upstream.status_code >= 500:
                return _Retry(
                    f"http_{upstream.status_code}", f"HTTP {upstream.status_code}"
                ), response
            self._finish(span, start, worker.url, upstream.status_code, None)
            return response
        finally:
            if not handed_off:
                if upstream is not None:
                    await upstream.aclose()
                self.registry.end(worker)

    def _timeout(self, worker: Worker, err: Exception, span: trace.Span, start: float) -> Response:
        response = error_response(
            504, f"worker {worker.url} timed out ({type(err).__name__})", "gateway_timeout"
        )
        self._finish(span, start, worker.url, 504, None)
        return response

    async def _relay(
        self,
        worker: Worker,
        upstream: httpx.Response,
        out_headers: list[tuple[str, str]],
        span: trace.Span,
        start: float,
    ) -> Response | _Retry:
        chunks = upstream.aiter_raw()
        try:
            first = await anext(chunks, b"")
        except httpx.TimeoutException as err:
            return self._timeout(worker, err, span, start)
        except httpx.TransportError as err:
            self.registry.record_failure(worker, f"connection broken: {err!r}")
            return _Retry("transport", f"stream broke before its first byte ({type(err).__name__})")
        status = [upstream.status_code]

        async def body() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.TransportError as err:
                status[0] = 599  # aborting the caller's connection: the stream is incomplete
                if not isinstance(err, httpx.TimeoutException):  # slow is not dead
                    self.registry.record_failure(worker, f"stream broke: {err!r}")
                raise

        async def cleanup() -> None:
            await upstream.aclose()
            self.registry.end(worker)
            self._finish(span, start, worker.url, status[0], None)

        response = _RelayResponse(body(), upstream.status_code, cleanup)
        return _with_headers(response, out_headers)

    def _finish(
        self, span: trace.Span, start: float, worker: str, status: int, attempts: int | None
    ) -> None:
        self.metrics.requests.labels(worker, str(status)).inc()
        self.metrics.latency.observe(time.perf_counter() - start)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("millstream.worker", worker)
        if attempts is not None:
            span.set_attribute("millstream.attempts", attempts)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        telemetry.mirror(self._tracer, span)  # in each served group's own trace
