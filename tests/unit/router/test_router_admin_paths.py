"""The router's guard on engine admin paths and its restart id (FastAPI TestClient, workers an
in-process transport): with a router token, an engine admin path proxied without it is a 401
that no worker sees, whether or not the engine has a token; every own answer carries the
router's id, which is new at each start."""

from __future__ import annotations

import pytest

from millstream.common.auth import ENGINE_ADMIN_PATHS, is_engine_admin_path
from tests.unit.router.test_router_api import A, Upstream, error_message, make_client

TOKEN = "r0uter-only"
GOOD = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("path", sorted(ENGINE_ADMIN_PATHS))
def test_every_engine_admin_path_needs_the_routers_token(path: str):
    up = Upstream()
    with make_client(up, admin_token=TOKEN, worker_urls=[A]) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            for method in ("POST", "GET"):
                r = client.request(method, path, json={}, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                assert "admin token" in error_message(r) and TOKEN not in r.text
        assert up.seen == []  # no engine was asked
        r = client.post(path, json={}, headers=GOOD)
        assert r.status_code == 200 and r.json()["path"] == path
        (seen,) = up.seen
        assert seen.headers["authorization"] == f"Bearer {TOKEN}"  # on to the engine


@pytest.mark.parametrize(
    "path", ["//pause_generation", "/pause_generation/", "/%70ause_generation", "/flush_cache//"]
)
def test_slashes_and_escapes_hide_no_admin_path(path: str):
    up = Upstream()
    with make_client(up, admin_token=TOKEN, worker_urls=[A]) as client:
        assert client.post("http://testserver" + path, json={}).status_code == 401
    assert up.seen == []


def test_data_paths_and_a_router_without_token_pass_as_before():
    up = Upstream()
    with make_client(up, admin_token=TOKEN, worker_urls=[A]) as client:
        assert client.post("/generate", json={"text": "hi"}).status_code == 200
        assert client.get("/get_server_info").status_code == 200
    with make_client(up, worker_urls=[A]) as client:  # no router token: the engine decides
        assert client.post("/pause_generation", json={}).status_code == 200
    assert [r.url.path for r in up.seen] == ["/generate", "/get_server_info", "/pause_generation"]


def test_is_engine_admin_path():
    assert is_engine_admin_path("/update_weights_from_tensor")
    assert is_engine_admin_path("///abort_request//")
    assert not is_engine_admin_path("/generate")
    assert not is_engine_admin_path("/pause_generation/x")
    assert not is_engine_admin_path("/Pause_Generation")  # the engine's routes are case-exact


def test_own_answers_carry_the_routers_id_new_at_each_start():
    with make_client(Upstream(), worker_urls=[A]) as client:
        ids = {
            client.get("/list_workers").headers["x-millstream-router"],
            client.get("/workers").headers["x-millstream-router"],
            client.get("/get_weight_version").headers["x-millstream-router"],
            client.post("/set_weight_version", json={"weight_version": "0"}).headers[
                "x-millstream-router"
            ],
        }
        assert len(ids) == 1
        assert "x-millstream-router" not in client.post("/generate", json={}).headers
    with make_client(Upstream()) as client:
        assert client.get("/list_workers").headers["x-millstream-router"] not in ids
