"""The admin token and the body size limit on real processes: an engine started with
--admin-token and a small --max-request-bytes, and a router (default limit) in front of it.

Every engine route is either an admin route (the token is required: 401 without it or with a
wrong one) or an open one (health, info, generation), and the two lists are written out here,
so a new route must be put in one of them; the admin paths are common/auth.py's, which the
router guards too: with a router token, an admin path through the router needs it, also in
front of an engine that has none. A body over the limit is a 413, declared by
Content-Length or counted as it streams in (chunked), and the service goes on serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from millstream.common.auth import ENGINE_ADMIN_PATHS
from millstream.common.fencing import FENCE_HEADER
from tests.support.engine_proc import EngineProcess
from tests.support.router_proc import ServiceProcess, start_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "adm1n-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMIT = 256 * 1024
SMALL = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}

ADMIN_ROUTES = {
    ("POST", "/abort_request"),
    ("POST", "/pause_generation"),
    ("POST", "/continue_generation"),
    ("GET", "/flush_cache"),
    ("POST", "/flush_cache"),
    ("POST", "/init_weights_update_group"),
    ("POST", "/destroy_weights_update_group"),
    ("POST", "/update_weights_from_distributed"),
    ("POST", "/update_weights_from_tensor"),
    ("POST", "/update_weights_from_disk"),
    ("POST", "/release_memory_occupation"),
    ("POST", "/resume_memory_occupation"),
}
OPEN_ROUTES = {
    ("POST", "/generate"),
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/model_info"),  # SGLang's current names for the two above
    ("GET", "/server_info"),
    ("GET", "/get_weight_version"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
}


@pytest.fixture(scope="module")
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    workdir = tmp_path_factory.mktemp("engine-admin")
    flags = ("--admin-token", TOKEN, "--max-request-bytes", str(LIMIT))
    proc = EngineProcess(tiny_model_dir, workdir, *flags)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def router(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    proc: ServiceProcess = start_router(
        tmp_path_factory.mktemp("router-admin"), "--worker-urls", engine.url
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=30.0) as c:
        yield c


def routes_of(api_router) -> set[tuple[str, str]]:
    return {(method, route.path) for route in api_router.routes for method in route.methods}


def paused(client: httpx.Client) -> bool:
    return client.get("/get_server_info").json()["scheduler"]["paused"]


def test_every_engine_route_is_either_admin_or_open():
    from millstream.engine.http.api import router as api_router
    from millstream.engine.http.control import router as control_router
    from millstream.engine.http.openai import router as openai_router

    assert routes_of(control_router) == ADMIN_ROUTES
    assert routes_of(api_router) | routes_of(openai_router) == OPEN_ROUTES
    assert {path for _, path in ADMIN_ROUTES} == ENGINE_ADMIN_PATHS  # the router's list


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": "Bearer"},
    ],
    ids=["none", "wrong", "not-bearer", "empty"],
)
def test_admin_routes_refuse_a_missing_or_wrong_token(client: httpx.Client, headers: dict):
    for method, path in sorted(ADMIN_ROUTES):
        body = {"json": {"mode": "abort"}} if method == "POST" else {}
        r = client.request(method, path, headers=headers, **body)
        assert r.status_code == 401, (method, path, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        error = r.json()
        assert error["code"] == 401 and error["type"] == "AuthenticationError"
        assert "admin token" in error["message"] and TOKEN not in r.text
    assert not paused(client)  # nothing got through


def test_admin_routes_answer_with_the_token(client: httpx.Client):
    r = client.post("/pause_generation", json={"mode": "abort"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["success"] is True
    assert paused(client)
    r = client.post("/continue_generation", json={}, headers=AUTH)
    assert r.status_code == 200 and not paused(client)
    assert client.post("/abort_request", json={"abort_all": True}, headers=AUTH).status_code == 200
    assert client.get("/flush_cache", headers=AUTH).status_code == 200
    # Past the token check, the endpoint's own answer: there is no such group.
    r = client.post("/destroy_weights_update_group", json={"group_name": "none"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["success"] is False


def test_open_routes_need_no_token(client: httpx.Client):
    for method, path in sorted(OPEN_ROUTES):
        if method == "GET":
            assert client.get(path).status_code == 200, path
    r = client.post("/generate", json=SMALL)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
    info = client.get("/get_server_info").json()
    assert "admin_token" not in info and TOKEN not in str(info)


def test_the_router_passes_the_callers_token_on_to_the_engine(router, client: httpx.Client):
    r = httpx.post(router.url + "/pause_generation", json={"mode": "abort"}, timeout=30)
    assert r.status_code == 401 and not paused(client)
    r = httpx.post(router.url + "/pause_generation", json={"mode": "abort"}, headers=AUTH)
    assert r.status_code == 200 and paused(client)
    r = httpx.post(router.url + "/continue_generation", json={}, headers=AUTH)
    assert r.status_code == 200 and not paused(client)


def test_a_router_token_guards_admin_paths_whether_or_not_the_engine_has_one(
    engine: EngineProcess, tiny_model_dir: Path, tmp_path: Path
):
    """Only the router has a token (the open engine behind it trusts its network), or both
    have it: either way an admin call through the router without the router's token is a
    401 and the engine stays as it was; with it, the call goes through."""
    open_engine = EngineProcess(tiny_model_dir, tmp_path)  # no --admin-token
    router = start_router(tmp_path, "--admin-token", TOKEN, "--worker-urls", open_engine.url)
    guarded = start_router(tmp_path, "--admin-token", TOKEN, "--worker-urls", engine.url)
    try:
        for front, behind in ((router, open_engine.url), (guarded, engine.url)):
            with httpx.Client(base_url=behind, timeout=30.0) as direct:
                for method, path in sorted(ADMIN_ROUTES):
                    for headers in ({}, {"Authorization": "Bearer wrong"}):
                        body = {"json": {"mode": "abort"}} if method == "POST" else {}
                        r = httpx.request(
                            method, front.url + path, headers=headers, timeout=30, **body
                        )
                        assert r.status_code == 401, (behind, method, path, r.text)
                        assert "admin token" in r.json()["error"]["message"]
                assert not paused(direct)
                r = httpx.post(
                    front.url + "/pause_generation", json={"mode": "abort"}, headers=AUTH
                )
                assert r.status_code == 200 and paused(direct)
                r = httpx.post(front.url + "/continue_generation", json={}, headers=AUTH)
                assert r.status_code == 200 and not paused(direct)
            r = httpx.post(front.url + "/generate", json=SMALL, timeout=60)  # data: no token
            assert r.status_code == 200
    finally:
        assert router.stop() == 0 and guarded.stop() == 0
        open_engine.stop()


def test_the_engine_refuses_a_body_over_its_limit_and_goes_on_serving(client: httpx.Client):
    padded = {**SMALL, "rid": ""}
    padded["rid"] = "r" * (LIMIT - len(httpx.Request("POST", "/", json=padded).content))
    r = client.post("/generate", json=padded)  # exactly the limit: accepted
    assert r.status_code == 200, r.text

    r = client.post("/generate", content=b"x" * (LIMIT + 1))
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert r.json()["code"] == 413 and "--max-request-bytes" in r.json()["message"]
    r = client.post("/generate", content=iter([b"x" * 65536] * 8))  # chunked: no length
    assert r.status_code == 413 and "chunked" in r.json()["message"]
    # An admin route reads no body over the limit either, token or not.
    r = client.post("/update_weights_from_tensor", content=iter([b"x" * 65536] * 8), headers=AUTH)
    assert r.status_code == 413

    assert client.post("/generate", json=SMALL).status_code == 200
    assert client.get("/health").status_code == 200


def test_the_router_refuses_50_mb_at_once_and_goes_on_serving(router):
    big = b"x" * (50 * 1024**2)  # over the default 32 MiB
    with httpx.Client(base_url=router.url, timeout=30.0) as c:
        start = time.monotonic()
        r = c.post("/generate", content=big)
        assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
        r = c.post("/generate", content=iter([big[: 1024**2]] * 50))
        assert r.status_code == 413 and "chunked" in r.json()["error"]["message"]
        assert time.monotonic() - start < 10
        r = c.post("/add_worker", content=big)  # the router's own endpoints too
        assert r.status_code == 413

        r = c.post("/generate", json=SMALL)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1
        assert c.get("/readiness").status_code == 200


def test_an_older_trainers_admin_calls_are_refused_by_the_engine_and_the_router(
    client: httpx.Client, router
):
    """Fencing numbers (common/fencing.py): once a trainer of a run has called with number
    N, a call of that run with a smaller one is a 409 and changes nothing, at the engine and
    at the router (its own endpoints and the engine admin paths it proxies); other runs and
    calls without the header are not fenced."""
    new, old = {**AUTH, FENCE_HEADER: "fenced-run/200"}, {**AUTH, FENCE_HEADER: "fenced-run/199"}
    assert client.post("/pause_generation", json={"mode": "abort"}, headers=new).status_code == 200
    r = client.post("/continue_generation", json={}, headers=old)
    assert r.status_code == 409 and "fenced" in r.json()["message"], r.text
    assert "200" in r.json()["message"] and paused(client)  # names the holder's number
    other_run = {**AUTH, FENCE_HEADER: "another-run/1"}
    assert client.post("/continue_generation", json={}, headers=other_run).status_code == 200
    assert client.post("/pause_generation", json={"mode": "abort"}, headers=AUTH).status_code == 200
    assert client.post("/continue_generation", json={}, headers=new).status_code == 200
    assert not paused(client)
    bad = client.post("/continue_generation", json={}, headers={**AUTH, FENCE_HEADER: "x"})
    assert bad.status_code == 409 and "malformed" in bad.json()["message"]

    with httpx.Client(base_url=router.url, timeout=30.0) as via:
        # Proxied to the engine: the router refuses before the engine sees it.
        ok = via.post("/pause_generation", json={"mode": "abort"}, headers=new)
        assert ok.status_code == 200, ok.text
        r = via.post("/continue_generation", json={}, headers=old)
        assert r.status_code == 409 and "fenced" in r.text and paused(client)
        assert via.post("/continue_generation", json={}, headers=new).status_code == 200
        # The router's own admin endpoints.
        before = via.get("/get_weight_version").json()
        r = via.post("/set_weight_version", json={"weight_version": "99"}, headers=old)
        assert r.status_code == 409 and "fenced" in r.text
        assert via.get("/get_weight_version").json() == before
        r = via.post("/set_weight_version", json={"weight_version": "99"}, headers=new)
        assert r.status_code == 200, r.text
        via.post("/set_weight_version", json={"weight_version": None}, headers=new)
