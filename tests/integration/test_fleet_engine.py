"""The fleet bench's simulated engines (bench/fleet_engine.py) behind the real router: they
serve /generate in SGLang's shapes through it, the router spreads requests over them and gates
them by weight version, a pause with mode abort ends a running generation, and the trainer's
real weight sync (pause, update from disk, continue) brings both to a new version."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.support.fleet import FleetProcess
from tests.support.router_proc import start_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

BODY = {
    "input_ids": [11, 12, 13],
    "sampling_params": {"max_new_tokens": 8, "n": 2},
    "return_logprob": True,
}


def test_simulated_engines_serve_through_the_real_router(tmp_path):
    fleet = FleetProcess(tmp_path, engines=2, args=["--decode-step-ms", "20"])
    router = None
    try:
        router = start_router(tmp_path, "--worker-urls", *fleet.urls)
        with httpx.Client(base_url=router.url, timeout=30) as client:
            served = set()
            for _ in range(8):
                r = client.post("/generate", json=BODY)
                assert r.status_code == 200, r.text
                answers = r.json()
                assert len(answers) == 2
                for a in answers:
                    pairs = a["meta_info"]["output_token_logprobs"]
                    assert len(pairs) == 8 and a["output_ids"] == [p[1] for p in pairs]
                    assert a["meta_info"]["finish_reason"]["type"] == "length"
                    assert a["meta_info"]["weight_version"] == "0"
                    assert len(a["text"]) == 8 * 4
                served.add(r.headers["x-millstream-worker"])
            assert served == set(fleet.urls)  # least in flight: ties go round robin
            batch = {
                "input_ids": [[1, 2], [3, 4, 5]],
                "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 3}],
                "rid": ["a", "b"],
                "return_logprob": True,
            }
            answers = client.post("/generate", json=batch).json()
            assert [a["meta_info"]["prompt_tokens"] for a in answers] == [2, 3]
            counts = [fleet.stats(u)["requests"] for u in fleet.urls]
            assert sum(counts) == 9 and min(counts) >= 4

            # Gated on version 3, which only the first engine holds: it alone serves.
            first, second = fleet.urls
            update = {"model_path": "/nowhere", "weight_version": "3"}
            assert httpx.post(f"{first}/update_weights_from_disk", json=update).json()["success"]
            gate = client.post("/set_weight_version", json={"weight_version": "3"}).json()
            assert gate["eligible"] == [first]
            r = client.post("/generate", json=BODY)
            assert r.headers["x-millstream-worker"] == first
            assert r.json()[0]["meta_info"]["weight_version"] == "3"

        # A pause with mode abort ends a running generation with the tokens made so far.
        answer: dict = {}

        def long_request() -> None:
            body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 200}}
            answer.update(httpx.post(f"{second}/generate", json=body, timeout=30).json())

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)  # 200 tokens at 20 ms a step: 4 s
        httpx.post(f"{second}/pause_generation", json={"mode": "abort"})
        thread.join(10)
        assert answer["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < answer["meta_info"]["completion_tokens"] < 200
        httpx.post(f"{second}/continue_generation", json={})

        # The trainer's weight sync: every engine the router lists paused, updated, continued.
        report = asyncio.run(_sync(router.url, tmp_path))
        assert sorted(report.engines) == sorted(fleet.urls) and not report.removed
        assert {"pause", "disk", "serve"} <= set(report.seconds)
        for url in fleet.urls:
            stats = fleet.stats(url)
            assert stats["weight_version"] == "4" and stats["pauses"] >= 1
        eligible = httpx.get(f"{router.url}/workers").json()["workers"]
        assert all(w["eligible"] for w in eligible)
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


async def _sync(router_url: str, tmp_path):
    import torch

    from millstream.trainer.weights.sync import WeightSync

    sync = WeightSync(router_url, transport="disk", disk_dir=tmp_path / "weights", timeout_s=30)
    try:
        return await sync.sync([("w", torch.zeros(16))], 4)
    finally:
        await sync.close()
