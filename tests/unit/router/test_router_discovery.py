"""--discover-workers: the router keeps one worker per address a name resolves to.

The resolver is injected (a dict we change between rounds) and the workers are an in-process
httpx transport, so every round is driven by hand (`discover()` in the app's event loop).
A real router and a real engine resolving "localhost": tests/integration/test_router_discovery.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import httpx
import pytest
from fastapi.testclient import TestClient

from millstream.router.api import build_app
from millstream.router.config import RouterConfig, parse_router_config
from millstream.router.discovery import resolve_addresses, worker_url

ONE, TWO, THREE = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"
STATIC = "http://10.0.0.9:30000"
HANG = RuntimeError("never raised: the lookup hangs")


class FakeDns:
    """Names to addresses; a name mapped to an exception raises it (a failed lookup), one
    mapped to HANG never answers."""

    def __init__(self, **names: list[str] | Exception):
        self.names = names
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        answer = self.names.get(host, [])
        if answer is HANG:
            await asyncio.sleep(3600)
        if isinstance(answer, Exception):
            raise answer
        return list(answer)


class Workers:
    """Every address answers /health and /get_weight_version (its version, "0" by default)
    unless it is down; anything else answers with the worker's own URL."""

    def __init__(self) -> None:
        self.versions: dict[str, str] = {}
        self.down: set[str] = set()
        self.served: Counter[str] = Counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": self.versions.get(base, "0")})
        self.served[base] += 1
        # An unread stream, as from a socket (the proxy streams what it relays).
        body = httpx.ByteStream(json.dumps({"worker": base}).encode())
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=body)


def app_for(dns: FakeDns, workers: Workers, **cfg) -> TestClient:
    cfg = {
        "discover_workers": ["sglang:30000"],
        "discover_interval": 3600.0,  # rounds are run by hand, after the first one
        "health_check_interval": 3600.0,
        **cfg,
    }
    app = build_app(RouterConfig(**cfg), transport=httpx.MockTransport(workers), resolve=dns)
    return TestClient(app)


def listed(client: TestClient) -> set[str]:
    return set(client.get("/list_workers").json()["urls"])


def discover(client: TestClient) -> None:
    """One discovery round, in the app's event loop."""
    client.portal.call(client.app.state.router.discovery.discover)


def first_round(client: TestClient, expected: set[str]) -> None:
    """The loop's first round runs at start-up, in the background: wait for it."""
    deadline = time.monotonic() + 10
    while listed(client) != expected:
        assert time.monotonic() < deadline, listed(client)
        time.sleep(0.01)


def by_url(client: TestClient) -> dict[str, dict]:
    return {w["url"]: w for w in client.get("/workers").json()["workers"]}


def test_flags_parse_and_bad_targets_are_refused_by_name(capsys):
    cfg = parse_router_config(
        ["--discover-workers", "sglang:30000", "[::1]:8000", "sglang:30000"], environ={}
    )
    assert cfg.discover_workers == ["sglang:30000", "[::1]:8000"]
    assert cfg.discover_interval == 5.0
    assert parse_router_config(["--discover-interval", "0.5"], environ={}).discover_interval == 0.5
    for bad in ("sglang", "sglang:http", "sglang:0", "::1:80", "http://sglang:30000", ":30000"):
        with pytest.raises(SystemExit):
            parse_router_config(["--discover-workers", bad], environ={})
        assert "--discover-workers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_router_config(["--discover-interval", "0"], environ={})
    assert "--discover-interval must be > 0" in capsys.readouterr().err


def test_every_address_becomes_a_worker_and_one_that_leaves_is_removed():
    dns, workers = FakeDns(sglang=["10.0.0.1", "10.0.0.2"]), Workers()
    with app_for(dns, workers, health_check_timeout=0.2) as client:
        first_round(client, {ONE, TWO})
        assert dns.asked[0] == ("sglang", 30000)
        assert all(w["health"] == "healthy" for w in by_url(client).values())
        # Every replica is routed to, not one name.
        for _ in range(4):
            assert client.post("/generate", json={}).status_code == 200
        assert set(workers.served) == {ONE, TWO}

        dns.names["sglang"] = ["10.0.0.2", "10.0.0.3"]  # a replica stopped, one started
        discover(client)
        assert listed(client) == {TWO, THREE}
        dns.names["sglang"] = socket.gaierror(socket.EAI_AGAIN, "temporary failure")
        discover(client)  # a failed lookup changes nothing
        assert listed(client) == {TWO, THREE}
        dns.names["sglang"] = HANG
        discover(client)  # a lookup that takes longer than --health-check-timeout fails
        assert listed(client) == {TWO, THREE}
        dns.names["sglang"] = []  # no replica left
        discover(client)
        assert listed(client) == set()


def test_an_address_is_added_once_it_answers_health():
    """A replica still loading its model resolves before it serves: it is not listed (the
    trainer's sync would try it and fail) until /health answers."""
    dns, workers = FakeDns(sglang=["10.0.0.1", "10.0.0.2"]), Workers()
    workers.down.add(TWO)
    with app_for(dns, workers) as client:
        first_round(client, {ONE})
        discover(client)
        assert listed(client) == {ONE}
        workers.down.clear()
        discover(client)
        assert listed(client) == {ONE, TWO}


def test_workers_it_did_not_add_are_never_removed():
    """--worker-urls and /add_worker stay, whatever the name resolves to; so does a worker
    both listed by flag and resolved."""
    dns, workers = FakeDns(sglang=["10.0.0.1", "10.0.0.9"]), Workers()
    with app_for(dns, workers, worker_urls=[STATIC]) as client:
        first_round(client, {ONE, STATIC})
        assert client.app.state.router.discovery.added == {ONE}
        dns.names["sglang"] = []
        discover(client)
        assert listed(client) == {STATIC}


def test_a_discovered_worker_gets_no_traffic_until_it_reports_the_expected_version():
    """The trainer has synced version 3 to the replicas it knew; a replica that appears now
    holds other weights. It is listed (so the trainer's next sync, which pushes to every worker
    the router lists, reaches it) but gets no request until it reports version 3."""
    dns, workers = FakeDns(sglang=["10.0.0.1"]), Workers()
    workers.versions = {ONE: "3", TWO: "default"}  # SGLang's version before any update
    with app_for(dns, workers) as client:
        first_round(client, {ONE})
        r = client.post("/set_weight_version", json={"weight_version": "3"})
        assert r.json() == {"weight_version": "3", "eligible": [ONE]}

        dns.names["sglang"] = ["10.0.0.1", "10.0.0.2"]
        discover(client)
        two = by_url(client)[TWO]
        assert two["health"] == "healthy" and two["weight_version"] == "default"
        assert not two["eligible"]
        for _ in range(6):
            assert client.post("/generate", json={}).json() == {"worker": ONE}
        assert TWO not in workers.served

        # The trainer's next sync: the weights reach it, it reports version 3 (the health
        # round reads it; a sync vouches for it at once, as below).
        workers.versions[TWO] = "3"
        client.portal.call(client.app.state.router.health.check_all)
        assert by_url(client)[TWO]["eligible"]
        for _ in range(6):
            client.post("/generate", json={})
        assert workers.served[TWO] > 0


def test_a_worker_removed_while_it_resolves_comes_back_gated():
    """The trainer removes an engine that failed a sync step; an SGLang server cannot ask to
    join again, so the next round adds it back, gated until a sync brings it the version."""
    dns, workers = FakeDns(sglang=["10.0.0.1", "10.0.0.2"]), Workers()
    workers.versions = {ONE: "4", TWO: "3"}
    with app_for(dns, workers) as client:
        first_round(client, {ONE, TWO})
        client.post("/set_weight_version", json={"weight_version": "4"})
        client.post("/remove_worker", params={"url": TWO})
        assert listed(client) == {ONE}
        discover(client)
        assert listed(client) == {ONE, TWO}
        assert not by_url(client)[TWO]["eligible"]
        r = client.post(
            "/set_weight_version", json={"weight_version": "4", "workers_at_version": [TWO]}
        )
        assert r.json()["eligible"] == [ONE, TWO]


def test_several_names_and_ipv6_addresses():
    dns = FakeDns(sglang=["10.0.0.1"], other=["fd00::2"])
    with app_for(dns, Workers(), discover_workers=["sglang:30000", "other:8000"]) as client:
        first_round(client, {ONE, "http://[fd00::2]:8000"})
    assert (
        worker_url("::1", 1) == "http://[::1]:1"
        and worker_url("10.0.0.1", 2) == "http://10.0.0.1:2"
    )


def test_the_system_resolver_answers_a_missing_name_with_no_address(monkeypatch):
    loop = asyncio.new_event_loop()
    try:
        assert "127.0.0.1" in loop.run_until_complete(resolve_addresses("localhost", 80))

        async def nxdomain(*_args, **_kwargs):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        async def unreachable(*_args, **_kwargs):
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

        monkeypatch.setattr(loop, "getaddrinfo", nxdomain)
        assert loop.run_until_complete(resolve_addresses("sglang", 30000)) == []
        monkeypatch.setattr(loop, "getaddrinfo", unreachable)
        with pytest.raises(OSError, match="Temporary failure"):
            loop.run_until_complete(resolve_addresses("sglang", 30000))
    finally:
        loop.close()
