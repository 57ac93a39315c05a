"""The router app alone (FastAPI TestClient); upstream workers are an in-process httpx transport.

Covers: admin token, bad JSON / unknown fields -> 4xx naming the field, registry endpoint
shapes (Miles and sglang-router), byte-exact bodies and hop-by-hop stripping both ways, SSE
relay, retries (refused connection, 5xx), 503 without a worker, version gating, trace
context continuation, /metrics. Real engines behind a real router: tests/integration.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from millstream.router.api import build_app
from millstream.router.config import RouterConfig
from millstream.router.proxy import HOP_BY_HOP, REQUEST_DROP, RESPONSE_DROP, strip_headers

A, B = "http://a.test:1", "http://b.test:2"
Handler = Callable[[httpx.Request], httpx.Response]


class Upstream:
    """Workers by base URL: each answers /health, /get_weight_version and `routes`."""

    def __init__(self, versions: dict[str, str] | None = None):
        self.seen: list[httpx.Request] = []
        self.probes: list[str] = []  # the bases asked /get_weight_version, in order
        self.versions = versions or {}
        self.handlers: dict[str, Handler] = {}
        self.down: set[str] = set()

    def base(self, request: httpx.Request) -> str:
        return f"{request.url.scheme}://{request.url.host}:{request.url.port}"

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = self.base(request)
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/get_weight_version":
            self.probes.append(base)
            return httpx.Response(200, json={"weight_version": self.versions.get(base, "0")})
        await request.aread()
        self.seen.append(request)
        if base in self.handlers:
            return as_network(self.handlers[base](request))
        return as_network(httpx.Response(200, json={"worker": base, "path": request.url.path}))


def as_network(response: httpx.Response) -> httpx.Response:
    """httpx pre-reads a body given as bytes; a socket's response is an unread stream."""
    if not response.is_stream_consumed:
        return response
    stream = httpx.ByteStream(response.content)
    return httpx.Response(response.status_code, headers=response.headers, stream=stream)


def make_client(upstream: Upstream, tracer=None, **cfg) -> TestClient:
    cfg.setdefault("health_check_interval", 3600.0)
    app = build_app(RouterConfig(**cfg), transport=httpx.MockTransport(upstream), tracer=tracer)
    return TestClient(app, raise_server_exceptions=True)


def error_message(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    return body["error"]["message"]


def test_strip_headers_drops_hop_by_hop_and_connection_named():
    headers = [
        ("Connection", "keep-alive, X-Drop-Me"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic x"),
        ("Proxy-Authenticate", "Basic"),
        ("Trailer", "X-Sum"),
        ("X-Drop-Me", "1"),
        ("Content-Length", "3"),
        ("Host", "router"),
        ("X-Keep", "yes"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
    ]
    kept = strip_headers(headers, REQUEST_DROP)
    assert kept == [("x-keep", "yes"), ("set-cookie", "a=1"), ("set-cookie", "b=2")]
    assert strip_headers(headers, RESPONSE_DROP)[-3:] == kept
    assert "host" in dict(strip_headers(headers, HOP_BY_HOP))


def test_admin_token_guards_mutations_only():
    up = Upstream()
    with make_client(up, admin_token="s3cret") as client:
        good = {"Authorization": "Bearer s3cret"}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic s3cret"}):
            r = client.post("/add_worker", params={"url": A}, headers=headers)
            assert r.status_code == 401 and "admin token" in error_message(r)
            assert r.headers["www-authenticate"] == "Bearer"
        assert client.get("/list_workers").json() == {"urls": []}
        assert client.post("/add_worker", params={"url": A}, headers=good).status_code == 200
        worker_id = client.get("/workers").json()["workers"][0]["id"]
        assert client.post("/generate", json={"text": "hi"}).status_code == 200  # proxied: no token
        assert client.post("/workers", json={"url": B}).status_code == 401
        assert client.delete(f"/workers/{worker_id}").status_code == 401
        assert client.post("/remove_worker", json={"url": A}).status_code == 401
        assert client.post("/set_weight_version", json={"weight_version": "1"}).status_code == 401
        assert (
            client.post(
                "/set_weight_version", json={"weight_version": "1"}, headers=good
            ).status_code
            == 200
        )
        assert client.delete(f"/workers/{worker_id}", headers=good).status_code == 202


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "needle"),
    [
        ("post", "/add_worker", {"content": b"{bad"}, "not valid JSON"),
        ("post", "/add_worker", {"json": {"url": A, "bogus": 1}}, "bogus"),
        ("post", "/add_worker", {"json": {"url": 5}}, "'url'"),
        ("post", "/add_worker", {"json": {"url": "localhost:1"}}, "http://host:port"),
        ("post", "/add_worker", {"json": ["x"]}, "JSON object"),
        ("post", "/add_worker", {}, "'url' is required"),
        ("post", "/add_worker", {"params": {"url": A, "foo": "1"}}, "foo"),
        ("post", "/remove_worker", {"json": {"urll": A}}, "urll"),
        ("post", "/workers", {"json": {"url": A, "worker_type": "prefill"}}, "worker_type"),
        ("post", "/workers", {"json": {"url": A, "extra": 1}}, "extra"),
        ("post", "/workers", {"json": {}}, "'url' is required"),
        ("post", "/set_weight_version", {"json": {}}, "weight_version"),
        ("post", "/set_weight_version", {"json": {"weight_version": [1]}}, "weight_version"),
        ("post", "/set_weight_version", {"json": {"version": "1"}}, "version"),
        ("get", "/workers/not-an-id", {}, "not-an-id"),
        ("delete", "/workers/not-an-id", {}, "not-an-id"),
    ],
)
def test_bad_input_gets_4xx_naming_the_field(method, path, kwargs, needle):
    with make_client(Upstream()) as client:
        r = getattr(client, method)(path, **kwargs)
        assert 400 <= r.status_code < 500, r.text
        assert needle in error_message(r)


def test_registry_endpoints_speak_miles_and_sglang_router():
    with make_client(Upstream()) as client:
        r = client.post("/add_worker", params={"url": A + "/"})
        assert r.status_code == 200
        assert r.json()["status"] == "success" and r.json()["worker_urls"] == {A: 0}
        r = client.post("/add_worker", json={"url": A})  # idempotent
        assert r.json()["worker_urls"] == {A: 0}
        r = client.post("/workers", json={"url": B, "model_id": "tiny"})
        assert r.status_code == 202
        body = r.json()
        assert body["status"] == "accepted" and body["url"] == B
        assert r.headers["location"] == f"/workers/{body['worker_id']}"
        assert client.get("/list_workers").json() == {"urls": [A, B]}
        listed = client.get("/workers").json()
        assert listed["total"] == 2 and listed["stats"]["regular_count"] == 2
        w = listed["workers"][1]
        assert w["id"] == body["worker_id"] and w["model_id"] == "tiny"
        assert w["is_healthy"] is True and w["health"] == "healthy" and w["load"] == 0
        assert {"in_flight", "weight_version", "eligible"} <= set(w)
        assert client.get(f"/workers/{w['id']}").json()["url"] == B
        r = client.delete(f"/workers/{w['id']}")
        assert r.status_code == 202 and r.json()["worker_id"] == w["id"]
        assert client.post("/remove_worker", params={"url": A}).json()["worker_urls"] == {}
        assert client.get("/list_workers").json() == {"urls": []}


def test_proxy_is_byte_exact_and_strips_hop_by_hop_both_ways():
    up = Upstream()
    raw = b'{"meta_info": {"weight_version": "7", "x": 1.0000, "e2e_latency": 1e-3},  "text":"\\u00e9"}'

    def answer(request: httpx.Request) -> httpx.Response:
        headers = [
            ("content-type", "application/json"),
            ("connection", "close, x-secret"),
            ("keep-alive", "timeout=1"),
            ("x-secret", "hop"),
            ("x-engine", "yes"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
        ]
        return httpx.Response(201, headers=headers, content=raw)

    up.handlers[A] = answer
    with make_client(up, worker_urls=[A]) as client:
        del client.headers["accept-encoding"]  # a caller that did not ask for compression
        sent = b'{"input_ids":  [1, 2],\n "sampling_params": {"max_new_tokens": 1.50}}'
        r = client.post(
            "/generate?rid=r1&x=%2F",
            content=sent,
            headers={
                "content-type": "application/json",
                "connection": "keep-alive, x-hop",
                "x-hop": "1",
                "te": "trailers",
                "proxy-authorization": "Basic x",
                "upgrade": "h2c",
                "x-custom": "kept",
                "authorization": "Bearer for-the-engine",
            },
        )
        assert r.status_code == 201
        assert r.content == raw  # not re-serialised
        assert r.headers["x-engine"] == "yes" and r.headers["x-millstream-worker"] == A
        assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
        for name in ("keep-alive", "x-secret"):
            assert name not in r.headers
        assert r.headers["content-length"] == str(len(raw))

    (req,) = up.seen
    assert req.content == sent
    assert req.method == "POST" and req.url.raw_path == b"/generate?rid=r1&x=%2F"
    assert req.headers["x-custom"] == "kept"
    assert req.headers["authorization"] == "Bearer for-the-engine"
    assert req.headers["content-length"] == str(len(sent))
    for name in ("te", "proxy-authorization", "upgrade", "x-hop", "keep-alive"):
        assert name not in req.headers, name
    assert req.headers.get("connection", "keep-alive") == "keep-alive"  # the router's own, if any
    assert req.headers["accept-encoding"] == "identity"  # bodies are relayed still encoded
    assert req.headers["x-forwarded-for"] == "testclient"


def test_encoding_and_head_pass_through():
    up = Upstream()
    up.handlers[A] = lambda request: httpx.Response(
        200, headers={"content-encoding": "gzip", "content-length": "1234"}, content=b""
    )
    with make_client(up, worker_urls=[A]) as client:
        r = client.head("/some/file", headers={"accept-encoding": "gzip"})
        assert r.status_code == 200 and r.headers["content-length"] == "1234"
        assert r.headers["content-encoding"] == "gzip"
    assert up.seen[0].method == "HEAD" and up.seen[0].headers["accept-encoding"] == "gzip"


def test_sse_is_relayed_chunk_by_chunk():
    up = Upstream()
    events = [b'data: {"text": "a"}\n\n', b'data: {"text": "ab"}\n\n', b"data: [DONE]\n\n"]

    async def chunks() -> AsyncIterator[bytes]:
        for e in events:
            yield e

    up.handlers[A] = lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=chunks()
    )
    with make_client(up, worker_urls=[A]) as client:
        with client.stream("POST", "/generate", json={"text": "x", "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream"
            assert "content-length" not in r.headers
            got = list(r.iter_raw())
        assert b"".join(got) == b"".join(events)
        assert client.get("/workers").json()["workers"][0]["in_flight"] == 0


def test_a_stream_broken_after_its_first_byte_is_aborted_not_retried():
    up = Upstream()

    async def chunks() -> AsyncIterator[bytes]:
        yield b'data: {"text": "a"}\n\n'
        raise httpx.ReadError("worker died mid-stream")

    up.handlers[A] = lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=chunks()
    )
    with make_client(up, worker_urls=[A, B]) as client:
        with pytest.raises(httpx.ReadError):  # the caller sees a broken stream, not a clean end
            for _ in range(2):  # least in-flight alternates: make sure A is hit
                with client.stream("POST", "/generate", json={"stream": True}) as r:
                    list(r.iter_raw())
        workers = {w["url"]: w for w in client.get("/workers").json()["workers"]}
        assert workers[A]["in_flight"] == 0 and workers[A]["consecutive_failures"] == 1
        assert "mid-stream" in workers[A]["last_error"]
        assert [up.base(q) for q in up.seen].count(A) == 1  # not retried after its first byte
        assert "retries_total{" not in client.get("/metrics").text


def test_refused_connection_is_retried_on_another_worker_and_counted():
    up = Upstream()
    with make_client(
        up, worker_urls=[A, B], health_failure_threshold=2, router_policy="round_robin"
    ) as client:
        up.down.add(A)
        statuses = [client.post("/generate", json={"i": i}) for i in range(4)]
        assert all(r.status_code == 200 and r.json()["worker"] == B for r in statuses)
        workers = {w["url"]: w for w in client.get("/workers").json()["workers"]}
        assert workers[A]["health"] == "unhealthy"  # 2 refused connections = the threshold
        assert "connect" in workers[A]["last_error"]
        metrics = client.get("/metrics").text
        assert f'millstream_router_retries_total{{reason="connect",worker="{A}"}} 2.0' in metrics
        up.down.add(B)
        r = client.post("/generate", json={})
        assert r.status_code == 502 and "connect failed" in error_message(r)


def test_5xx_is_retried_and_the_last_5xx_passes_through_when_all_fail():
    up = Upstream()
    up.handlers[A] = lambda request: httpx.Response(500, json={"error": "boom A"})
    with make_client(up, worker_urls=[A, B], router_policy="round_robin", max_retries=1) as client:
        assert all(client.post("/generate", json={}).json()["worker"] == B for _ in range(4))
        up.handlers[B] = lambda request: httpx.Response(503, json={"error": "boom B"})
        up.seen.clear()
        r = client.post("/generate", json={})
        assert r.status_code in (500, 503) and r.json()["error"].startswith("boom")
        assert sorted(up.base(q) for q in up.seen) == [A, B]  # one retry, on the other worker
        with make_client(up, worker_urls=[A, B], max_retries=0) as no_retry:
            assert no_retry.post("/generate", json={}).status_code >= 500


def test_no_worker_is_a_quick_503_with_a_json_error():
    up = Upstream()
    with make_client(up) as client:
        r = client.post("/generate", json={"text": "x"})
        assert r.status_code == 503 and "no worker registered" in error_message(r)
        assert client.get("/readiness").status_code == 503
        assert client.get("/liveness").json() == {"status": "ok"}
    up.down.add(A)
    with make_client(up, worker_urls=[A], health_failure_threshold=1) as client:
        r = client.get("/health")  # proxied like any other path
        assert r.status_code == 503 and A in error_message(r)


def test_health_rounds_come_fast_while_no_worker_can_serve():
    """Start-up: the engine answers a moment after the router's first round; the router must
    not wait a whole --health-check-interval to serve it."""
    up = Upstream()
    up.down.add(A)
    with make_client(
        up, worker_urls=[A], health_check_interval=30.0, health_failure_threshold=1
    ) as client:
        assert client.get("/readiness").status_code == 503
        up.down.clear()
        deadline = time.monotonic() + 5.0
        while client.get("/readiness").status_code != 200:
            assert time.monotonic() < deadline, "no health round within 5 s of a 30 s interval"
            time.sleep(0.05)
        r = client.post("/generate", json={})
        assert r.status_code == 200 and r.json()["worker"] == A
        health = client.app.state.router.health  # back to the slow schedule once one serves
        assert health.next_wait() == 30.0


def test_version_gating_routes_only_to_the_expected_version():
    up = Upstream(versions={A: "1", B: "2"})
    # No engine at version 3 below: the request waits this long for one, then gets its 503.
    with make_client(up, worker_urls=[A, B], version_wait_timeout=0.2) as client:
        assert client.get("/get_weight_version").json() == {"weight_version": None}
        r = client.post("/set_weight_version", json={"weight_version": "2"})
        assert r.json() == {"weight_version": "2", "eligible": [B]}
        assert client.get("/get_weight_version").json() == {"weight_version": "2"}
        assert {client.post("/generate", json={}).json()["worker"] for _ in range(4)} == {B}
        assert client.get("/readiness").status_code == 200
        r = client.post("/set_weight_version", json={"weight_version": 3})
        assert r.json() == {"weight_version": "3", "eligible": []}
        r = client.post("/generate", json={})
        assert r.status_code == 503 and "weight version '3'" in error_message(r)
        up.versions[A] = "3"
        assert client.post("/set_weight_version", json={"weight_version": "3"}).json()[
            "eligible"
        ] == [A]
        assert client.post("/set_weight_version", json={"weight_version": None}).json()[
            "eligible"
        ] == [A, B]
        assert "/get_weight_version" not in [q.url.path for q in up.seen]  # answered by the router


def test_a_version_vouched_for_is_not_asked_again():
    """The trainer names the engines that confirmed V: the router gates on V without asking
    them; a worker it does not name is still asked (and one at another version excluded)."""
    up = Upstream(versions={A: "1", B: "1"})
    with make_client(up, worker_urls=[A, B]) as client:
        asked = len(up.probes)
        r = client.post("/set_weight_version", json={"weight_version": "2",
                                                     "workers_at_version": [A + "/"]})  # fmt: skip
        assert r.json() == {"weight_version": "2", "eligible": [A]}
        assert up.probes[asked:] == [B]
        assert {client.post("/generate", json={}).json()["worker"] for _ in range(3)} == {A}
        bad = client.post("/set_weight_version", json={"weight_version": "2",
                                                       "workers_at_version": A})  # fmt: skip
        assert bad.status_code == 400 and "workers_at_version" in error_message(bad)


def test_a_gate_without_reading_versions_asks_no_worker_and_routes_to_none_at_the_old_one():
    """A weight sync about to ship V gates on it first: the router asks no worker (none holds
    V yet), keeps their last known versions, and routes to none until one is vouched for."""
    up = Upstream(versions={A: "1", B: "1"})
    with make_client(up, worker_urls=[A, B]) as client:
        assert client.post("/set_weight_version", json={"weight_version": "1"}).json()[
            "eligible"
        ] == [A, B]
        asked = len(up.probes)
        r = client.post("/set_weight_version", json={"weight_version": "2", "read_versions": False})
        assert r.json() == {"weight_version": "2", "eligible": []} and up.probes[asked:] == []
        r = client.post("/set_weight_version", json={"weight_version": "2",
                                                     "workers_at_version": [B]})  # fmt: skip
        assert r.json()["eligible"] == [B]
        bad = client.post("/set_weight_version", json={"weight_version": "2", "read_versions": 0})
        assert bad.status_code == 400 and "read_versions" in error_message(bad)


def test_trace_context_is_continued_and_injected():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    up = Upstream()
    trace_id, parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with make_client(up, tracer=provider.get_tracer("t"), worker_urls=[A]) as client:
        client.post("/generate", json={}, headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "router.proxy"]
    assert f"{span.context.trace_id:032x}" == trace_id
    assert f"{span.parent.span_id:016x}" == parent
    assert span.attributes["millstream.worker"] == A
    forwarded = up.seen[0].headers["traceparent"]
    assert forwarded == f"00-{trace_id}-{span.context.span_id:016x}-01"


def test_metrics_report_requests_latency_in_flight_and_health():
    up = Upstream()
    up.handlers[B] = lambda request: httpx.Response(404, json={"detail": "nope"})
    with make_client(up, worker_urls=[A, B], router_policy="round_robin") as client:
        for _ in range(4):
            client.post("/generate", json={})
        r = client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
    assert f'millstream_router_requests_total{{status="200",worker="{A}"}} 2.0' in text
    assert f'millstream_router_requests_total{{status="404",worker="{B}"}} 2.0' in text
    assert "millstream_router_request_duration_seconds_count 4.0" in text
    assert f'millstream_router_worker_in_flight{{worker="{A}"}} 0.0' in text
    assert f'millstream_router_worker_health{{state="healthy",worker="{A}"}} 1.0' in text
    assert f'millstream_router_worker_eligible{{worker="{B}"}} 1.0' in text


def test_cache_aware_keeps_a_prompt_on_one_worker_through_the_app():
    up = Upstream()
    with make_client(up, worker_urls=[A, B], router_policy="cache_aware") as client:
        prompts = [list(range(i, i + 64)) for i in (0, 1000)]
        first = [client.post("/generate", json={"input_ids": p}).json()["worker"] for p in prompts]
        assert first[0] != first[1]
        for _ in range(3):
            for prompt, worker in zip(prompts, first, strict=True):
                body = json.dumps({"input_ids": prompt, "sampling_params": {"n": 1}})
                r = client.post(
                    "/generate", content=body, headers={"content-type": "application/json"}
                )
                assert r.json()["worker"] == worker


def test_sglang_info_names_reach_a_workers_get_info_endpoints():
    """/server_info and /model_info (SGLang's current names) ask a worker the /get_* ones,
    which every SGLang release and millstream's engine answer, query string kept."""
    up = Upstream()
    with make_client(up, worker_urls=[A]) as client:
        assert client.get("/server_info").json() == {"worker": A, "path": "/get_server_info"}
        assert client.get("/model_info?x=1").json()["path"] == "/get_model_info"
        assert client.get("/get_server_info").json()["path"] == "/get_server_info"
    assert [str(r.url) for r in up.seen] == [
        f"{A}/get_server_info", f"{A}/get_model_info?x=1", f"{A}/get_server_info"
    ]  # fmt: skip
