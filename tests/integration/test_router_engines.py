"""The router in front of real engines, all real processes on loopback, a tiny model.

Engines a (weight version v1) and b (v2) serve most tests; engine c exists to be SIGKILLed
mid-load. A faulty peer (a small HTTP server that answers 500) stands in for a broken worker
in the 5xx-retry test. Sync tests drive concurrent load with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.support.redis_server import free_port
from tests.support.router_proc import ServiceProcess, start_router

pytestmark = pytest.mark.integration

WORKER = "x-millstream-worker"
TOKEN = "integration-s3cret"


def generate_body(i: int = 0, max_new_tokens: int = 4, **extra) -> dict:
    return {
        "input_ids": [10 + i % 7, 20, 30, 40 + i % 3],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "return_logprob": True,
        **extra,
    }


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("engines")
    procs = {
        name: ServiceProcess(
            "engine",
            ["--model-path", str(tiny_model_dir), "--weight-version", version],
            workdir,
        )
        for name, version in (("a", "v1"), ("b", "v2"), ("c", "v1"))
    }
    try:
        for proc in procs.values():
            proc.wait_ready("/health", timeout_s=180)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture
def router_factory(tmp_path: Path) -> Iterator:
    started: list[ServiceProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServiceProcess:
        router = start_router(tmp_path, "--health-check-interval", "0.5", *args, env=env)
        started.append(router)
        return router

    yield start
    for router in started:
        assert router.stop() == 0  # a clean shutdown, no crash


def workers_by_url(router: ServiceProcess) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers").json()["workers"]}


async def burst(url: str, bodies: list[dict], timeout: float = 60.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=timeout) as client:
        return await asyncio.gather(*(client.post(url + "/generate", json=b) for b in bodies))


def test_requests_spread_over_both_engines_with_meta_info_intact(engines, router_factory):
    a, b = engines["a"], engines["b"]
    router = router_factory("--worker-urls", a.url, b.url)
    responses = asyncio.run(burst(router.url, [generate_body(i) for i in range(16)]))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    served = Counter(r.headers[WORKER] for r in responses)
    assert set(served) == {a.url, b.url}, served
    version_of = {a.url: "v1", b.url: "v2"}
    for r in responses:
        meta = r.json()["meta_info"]
        assert meta["weight_version"] == version_of[r.headers[WORKER]]
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert meta["completion_tokens"] == len(meta["output_token_logprobs"])
        assert all(len(entry) == 3 for entry in meta["output_token_logprobs"])

    # What the engine said, but for the request's own id and timing.
    body = generate_body(3)
    direct = httpx.post(a.url + "/generate", json=body, timeout=30).json()
    via = None
    for _ in range(6):  # least in-flight alternates between idle workers
        r = httpx.post(router.url + "/generate", json=body, timeout=30)
        if r.headers[WORKER] == a.url:
            via = r.json()
            break
    assert via is not None
    for payload in (direct, via):
        payload["meta_info"].pop("e2e_latency", None)
        payload["meta_info"].pop("id", None)
    assert via == direct


def test_sse_streams_through(engines, router_factory):
    router = router_factory("--worker-urls", engines["a"].url)
    body = generate_body(1, max_new_tokens=6, stream=True)
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", router.url + "/generate", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in r.headers
        text = "".join(r.iter_text())
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # Cumulative events (SGLang's default). How many there are depends on load: the engine
    # coalesces growth it has not flushed yet; chunk-by-chunk relaying is covered by the
    # router's unit tests with a controlled upstream.
    assert chunks
    for before, after in itertools.pairwise(chunks):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    whole = httpx.post(router.url + "/generate", json={**body, "stream": False}, timeout=30).json()
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == whole["meta_info"]["completion_tokens"]


def test_killing_an_engine_mid_load_fails_no_request(engines, router_factory):
    survivor, victim = engines["b"], engines["c"]
    router = router_factory(
        "--worker-urls",
        survivor.url,
        victim.url,
        "--health-failure-threshold",
        "2",
        "--max-retries",
        "2",
    )

    async def scenario() -> list[httpx.Response]:
        bodies = [generate_body(i, max_new_tokens=8) for i in range(40)]
        load = asyncio.ensure_future(burst(router.url, bodies))
        async with httpx.AsyncClient() as client:
            for _ in range(500):  # until the victim has work in flight through the router
                listed = (await client.get(router.url + "/workers")).json()["workers"]
                in_flight = {w["url"]: w["in_flight"] for w in listed}
                if in_flight[victim.url] > 0:
                    break
                await asyncio.sleep(0.01)
            assert in_flight[victim.url] > 0, "the victim never had work in flight"
        victim.kill()
        return await load

    responses = asyncio.run(scenario())
    failed = [(r.status_code, r.text) for r in responses if r.status_code != 200]
    assert not failed, failed
    assert all(r.json()["meta_info"]["completion_tokens"] >= 1 for r in responses)

    deadline = time.monotonic() + 20
    while workers_by_url(router)[victim.url]["health"] != "unhealthy":
        assert time.monotonic() < deadline, workers_by_url(router)
        time.sleep(0.1)
    after = asyncio.run(burst(router.url, [generate_body(i, max_new_tokens=2) for i in range(10)]))
    assert {(r.status_code, r.headers[WORKER]) for r in after} == {(200, survivor.url)}
    assert workers_by_url(router)[victim.url]["eligible"] is False
    metrics = httpx.get(router.url + "/metrics").text
    assert (
        f'millstream_router_worker_health{{state="unhealthy",worker="{victim.url}"}} 1.0' in metrics
    )
    retried = re.findall(
        rf'millstream_router_retries_total{{reason="\w+",worker="{re.escape(victim.url)}"}} (\S+)',
        metrics,
    )
    assert sum(float(n) for n in retried) >= 1  # its in-flight requests were retried, not failed


def test_admin_token_is_enforced(engines, router_factory):
    a = engines["a"]
    router = router_factory(env={"MILLSTREAM_ADMIN_TOKEN": TOKEN})
    r = httpx.post(router.url + "/add_worker", params={"url": a.url})
    assert r.status_code == 401 and "admin token" in r.json()["error"]["message"]
    r = httpx.post(
        router.url + "/add_worker", params={"url": a.url}, headers={"Authorization": "Bearer wrong"}
    )
    assert r.status_code == 401
    assert httpx.get(router.url + "/list_workers").json() == {"urls": []}
    r = httpx.post(
        router.url + "/add_worker",
        params={"url": a.url},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["worker_urls"] == {a.url: 0}
    r = httpx.post(router.url + "/generate", json=generate_body(), timeout=30)  # no token needed
    assert r.status_code == 200 and r.headers[WORKER] == a.url
    r = httpx.post(router.url + "/set_weight_version", json={"weight_version": "v1"})
    assert r.status_code == 401
    r = httpx.post(
        router.url + "/add_worker",
        content=b"{not json",
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_version_gating(engines, router_factory):
    a, b = engines["a"], engines["b"]
    router = router_factory("--worker-urls", a.url, b.url, "--version-wait-timeout", "0")
    r = httpx.post(router.url + "/set_weight_version", json={"weight_version": "v2"}, timeout=10)
    assert r.json() == {"weight_version": "v2", "eligible": [b.url]}
    assert httpx.get(router.url + "/get_weight_version").json() == {"weight_version": "v2"}
    responses = asyncio.run(burst(router.url, [generate_body(i) for i in range(8)]))
    assert {r.headers[WORKER] for r in responses} == {b.url}
    assert {r.json()["meta_info"]["weight_version"] for r in responses} == {"v2"}

    r = httpx.post(router.url + "/set_weight_version", json={"weight_version": "v3"}, timeout=10)
    assert r.json()["eligible"] == []
    r = httpx.post(router.url + "/generate", json=generate_body(), timeout=10)
    assert r.status_code == 503
    assert "weight version 'v3'" in r.json()["error"]["message"]

    httpx.post(router.url + "/set_weight_version", json={"weight_version": None}, timeout=10)
    responses = asyncio.run(burst(router.url, [generate_body(i) for i in range(8)]))
    assert {r.headers[WORKER] for r in responses} == {a.url, b.url}


def test_a_request_waits_for_the_version_a_sync_gated_on(engines, router_factory):
    """Gated on a version no worker holds yet (a weight sync gates ahead of its update), a
    request waits in the router instead of failing, and goes out once a worker has it; with
    nobody to bring the version, it fails with 503 after --version-wait-timeout."""
    a, b = engines["a"], engines["b"]
    router = router_factory("--worker-urls", a.url, b.url, "--version-wait-timeout", "1.5")
    r = httpx.post(router.url + "/set_weight_version", json={"weight_version": "v3"}, timeout=10)
    assert r.json()["eligible"] == []

    async def wait_then_vouch() -> tuple[httpx.Response, float, float]:
        async with httpx.AsyncClient(timeout=30) as client:
            start = time.monotonic()
            request = asyncio.create_task(
                client.post(router.url + "/generate", json=generate_body())
            )
            await asyncio.sleep(0.5)
            assert not request.done(), request.result().text
            vouched = time.monotonic()
            await client.post(
                router.url + "/set_weight_version",
                json={"weight_version": "v3", "workers_at_version": [a.url]},
            )
            response = await request
            return response, vouched - start, time.monotonic() - start

    response, vouched_after, answered_after = asyncio.run(wait_then_vouch())
    assert response.status_code == 200, response.text
    assert response.headers[WORKER] == a.url
    assert 0.5 <= vouched_after <= answered_after < 1.5  # sent when vouched, not on a timeout

    httpx.post(router.url + "/set_weight_version", json={"weight_version": "v4"}, timeout=10)
    start = time.monotonic()
    r = httpx.post(router.url + "/generate", json=generate_body(), timeout=10)
    assert r.status_code == 503 and "weight version 'v4'" in r.json()["error"]["message"]
    assert 1.5 <= time.monotonic() - start < 5


def test_no_worker_is_a_503_json_error(router_factory):
    router = router_factory()
    r = httpx.post(router.url + "/generate", json=generate_body(), timeout=10)
    assert r.status_code == 503
    assert "no worker registered" in r.json()["error"]["message"]
    dead = f"http://127.0.0.1:{free_port()}"
    router = router_factory("--worker-urls", dead, "--health-failure-threshold", "1")
    r = httpx.post(router.url + "/generate", json=generate_body(), timeout=10)
    assert r.status_code == 503 and dead in r.json()["error"]["message"]


class _FaultyPeer(BaseHTTPRequestHandler):
    """Healthy by /health, but every other request gets a 500."""

    hits = 0

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 500)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).hits += 1
        self._answer(500)

    def _answer(self, status: int) -> None:
        body = json.dumps({"error": {"message": "faulty peer"}}).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_5xx_is_retried_on_a_healthy_engine_and_counted(engines, router_factory):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FaultyPeer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    faulty = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        router = router_factory(
            "--worker-urls", faulty, engines["a"].url, "--router-policy", "round_robin"
        )
        responses = asyncio.run(burst(router.url, [generate_body(i) for i in range(8)]))
        assert {(r.status_code, r.headers[WORKER]) for r in responses} == {(200, engines["a"].url)}
        assert _FaultyPeer.hits >= 3  # round robin sent it a share, each retried elsewhere
        metrics = httpx.get(router.url + "/metrics").text
        assert f'millstream_router_retries_total{{reason="http_500",worker="{faulty}"}}' in metrics
        assert (
            f'millstream_router_requests_total{{status="200",worker="{engines["a"].url}"}} 8.0'
            in metrics
        )
        assert "millstream_router_request_duration_seconds_bucket" in metrics
    finally:
        server.shutdown()
        server.server_close()


def test_trace_context_continues_through_the_router(engines, router_factory, tmp_path):
    run_dir = tmp_path / "run"
    router = router_factory("--worker-urls", engines["a"].url, "--run-dir", str(run_dir))
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    other = f"{7:032x}-{9:016x}"  # a second group the request serves, in a trace of its own
    headers = {
        "traceparent": f"00-{trace_id}-{parent}-01",
        "x-millstream-groups": f"g1@{trace_id}-{parent},g2@{other}",
    }
    r = httpx.post(router.url + "/generate", json=generate_body(), headers=headers, timeout=30)
    assert r.status_code == 200
    assert router.stop() == 0  # flushes the span exporter
    files = list((run_dir / "traces").glob("router-*.jsonl"))
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    proxy = [s for s in lines if s["name"] == "router.proxy"]
    (span,) = [s for s in proxy if "millstream.mirror_of" not in s["attributes"]]
    # and a copy in the other group's own trace (a viewer shows one trace at a time)
    (copy,) = [s for s in proxy if "millstream.mirror_of" in s["attributes"]]
    assert f"{copy['trace_id']}-{copy['parent_span_id']}" == other
    assert span["trace_id"] == trace_id and span["parent_span_id"] == parent
    assert span["attributes"]["millstream.worker"] == engines["a"].url
    assert span["attributes"]["millstream.group_ids"] == ["g1", "g2"]
    assert [f"{x['trace_id']}-{x['span_id']}" for x in span["links"]] == [
        f"{trace_id}-{parent}",
        other,
    ]
