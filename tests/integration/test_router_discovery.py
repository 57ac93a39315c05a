"""--discover-workers with real processes on loopback: a router that resolves "localhost" finds
a real engine by its address, and keeps it out of routing until the trainer's weight sync
(this process as the trainer, WeightSync) brings it the version the router expects.

How a name's addresses come and go is the unit test's (tests/unit/router/test_router_discovery.py,
with a resolver it controls): here the system resolver answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from millstream.trainer.weights.sync import WeightSync
from tests.support.engine_proc import EngineProcess
from tests.support.router_proc import ServiceProcess, start_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

TOKEN = "discovery-secret"
BODY = {"input_ids": [10, 20, 30], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    logs = tmp_path_factory.mktemp("engine")
    proc = EngineProcess(tiny_model_dir, logs, "--weight-version", "v0", "--admin-token", TOKEN)
    yield proc
    proc.stop()


@pytest.fixture
def router(engine: EngineProcess, tmp_path: Path) -> Iterator[ServiceProcess]:
    proc = start_router(
        tmp_path,
        "--discover-workers", f"localhost:{engine.port}",
        "--discover-interval", "0.2",
        "--admin-token", TOKEN,
        "--health-check-timeout", "1",
        "--version-wait-timeout", "0",
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


def workers(router: ServiceProcess) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(router.url + "/workers").json()["workers"]}


def wait_listed(router: ServiceProcess, url: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (found := workers(router).get(url)) is None or found["health"] != "healthy":
        assert time.monotonic() < deadline, f"{url} not discovered:\n{router.log_tail()}"
        time.sleep(0.1)
    return found


def test_a_router_resolving_localhost_finds_the_engine(engine, router):
    wait_listed(router, engine.url)  # localhost -> 127.0.0.1 -> http://127.0.0.1:PORT
    # Only addresses that answer become workers (an engine listening on 127.0.0.1 alone is
    # not reached at ::1, where a resolver may also put localhost).
    assert httpx.get(router.url + "/list_workers").json()["urls"] == [engine.url]
    r = httpx.post(router.url + "/generate", json=BODY, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "v0"
    assert "discovering localhost:" in router.log_tail()
    assert f"worker {engine.url} discovered" in router.log_tail()


def test_a_discovered_engine_serves_once_the_trainers_sync_brings_it_the_version(
    engine, router, tiny_model_dir
):
    from transformers import AutoModelForCausalLM

    # The trainer is at version 1 already (as after a sync to the engines it knew): the
    # router serves only version 1, which the discovered engine does not hold.
    headers = {"Authorization": f"Bearer {TOKEN}"}
    gate = {"weight_version": "1", "read_versions": False}
    assert httpx.post(router.url + "/set_weight_version", json=gate, headers=headers).is_success
    found = wait_listed(router, engine.url)
    assert not found["eligible"] and found["weight_version"] in (None, "v0")
    r = httpx.post(router.url + "/generate", json=BODY, timeout=60)
    assert r.status_code == 503 and "weight version '1'" in r.json()["error"]["message"]

    # The trainer's next sync pushes to every engine the router lists: this one too.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    sync = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, group_name="discovered")
    loop = asyncio.new_event_loop()
    try:
        report = loop.run_until_complete(sync.sync(model.named_parameters(), 1))
        loop.run_until_complete(sync.close())
    finally:
        loop.close()
    assert report.engines == [engine.url] and report.removed == {}
    assert workers(router)[engine.url]["eligible"]
    r = httpx.post(router.url + "/generate", json=BODY, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "1"
