"""The coordinator handshake against real processes: a router, real engines on the tiny model,
and this process as rank 0 of the update group (gloo).

After a sync every engine reports the new version, the router serves it, and each engine
generates exactly what the trainer's HF model gives (greedy ids, logprobs within 1e-4): the
weights are equal. Failures: an engine that never answers is removed within the timeout and
the healthy one is still synced; an engine that fails in the middle of a broadcast is removed
and the group is rebuilt with the rest in the same sync. Router and engines all require the
admin token, so every call of the sync carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from millstream.common.errors import MillstreamError
from millstream.trainer.weights.sync import SyncReport, WeightSync
from tests.support.engine_proc import EngineProcess, start_engines
from tests.support.router_proc import ServiceProcess, start_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

TOKEN = "sync-secret"
PROMPTS = [list(b"Weights, please"), list(b"abc")]
NEW_TOKENS = 8
BUCKET_BYTES = 64 * 1024  # the tiny model is ~0.3 MB: several buckets


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProcess]]:
    logs = tmp_path_factory.mktemp("engines")
    # The engines guard their admin endpoints with the router's token: every pause, group
    # and bucket call of the sync must carry it.
    args = ("--weight-version", "v0", "--weight-update-timeout", "10", "--admin-token", TOKEN)
    procs = start_engines(tiny_model_dir, logs, 2, *args)
    yield procs
    for proc in procs:
        proc.stop()


@pytest.fixture
def router_of(tmp_path: Path) -> Iterator[Any]:
    started: list[ServiceProcess] = []

    def start(*urls: str) -> ServiceProcess:
        args = ["--admin-token", TOKEN, "--health-check-timeout", "1"]
        router = start_router(tmp_path, *args, "--worker-urls", *urls)
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


@pytest.fixture
def hanging_url() -> Iterator[str]:
    """An 'engine' that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def hf_model(model_dir: Path, seed: int):
    """The trainer's model: the tiny model with every parameter moved by seeded noise."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def assert_engine_equals(url: str, model, version: str, atol: float = 1e-4) -> None:
    """Greedy ids equal the HF model's greedy loop; logprobs equal its forward within `atol`."""
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    outs = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["meta_info"]["weight_version"] == version
        ids: list[int] = []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                ids.append(
                    int(model(input_ids=torch.tensor([prompt + ids])).logits[0, -1].argmax())
                )
            logits_TV = model(input_ids=torch.tensor([prompt + ids])).logits[0]
        assert out["output_ids"] == ids
        logp_TV = torch.log_softmax(logits_TV, -1)[len(prompt) - 1 : -1]
        expected_T = logp_TV.gather(-1, torch.tensor(ids)[:, None])[:, 0]
        got_T = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got_T, expected_T, atol=atol)


def versions(*urls: str) -> list[str]:
    return [httpx.get(f"{u}/get_weight_version").json()["weight_version"] for u in urls]


def served_version(url: str) -> str:
    """The weight version a short generation at `url` (a router or an engine) was made with."""
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    out = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    return out["meta_info"]["weight_version"]


def listed(router: ServiceProcess) -> list[str]:
    return httpx.get(f"{router.url}/list_workers").json()["urls"]


@pytest.fixture
def run() -> Iterator[Callable[[Awaitable[Any]], Any]]:
    """One event loop per test, as in the trainer: a WeightSync keeps its HTTP client for
    the life of the loop it first synced from."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


def sync(run, ws: WeightSync, model, version: int) -> SyncReport:
    return run(ws.sync(model.named_parameters(), version))


@pytest.mark.parametrize(
    ("transport", "load_format"),
    [("nccl", "flattened_bucket"), ("nccl", None), ("auto", "flattened_bucket")],
    ids=["group-flat", "group-per-tensor", "auto-tensor"],
)
def test_sync_makes_every_engine_equal_the_trainer_and_reuses_the_group(
    engines: list[EngineProcess], router_of, tiny_model_dir: Path, run, transport, load_format
):
    """nccl: an update group (gloo here), kept while its members stay; auto: these engines
    are on this machine's CPU, so each bucket goes as a shared-memory handle, no group."""
    urls = sorted(e.url for e in engines)
    router = router_of(urls[0])  # the other one asks to join (Coordinator.JoinEngine)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    ws = WeightSync(
        router.url,
        admin_token=TOKEN,
        bucket_bytes=BUCKET_BYTES,
        timeout_s=20,
        group_name="eq",
        tracer=provider.get_tracer("test"),
        load_format=load_format,
        transport=transport,
    )
    group = transport == "nccl"
    try:
        model = hf_model(tiny_model_dir, seed=1)
        first = run(ws.sync(model.named_parameters(), 1, join=[urls[1]]))
        assert first.engines == urls and first.removed == {}
        assert ws.members == (urls if group else [])
        assert first.new_group == group and first.buckets >= 3 and first.attempts == 1
        assert first.bytes == sum(p.numel() * p.element_size() for p in model.parameters())
        pushed = {"init", "broadcast"} if group else {"tensor"}
        assert set(first.seconds) >= {"pause", "serve", "total", *pushed}
        assert versions(*urls) == ["1", "1"]
        assert httpx.get(f"{router.url}/get_weight_version").json()["weight_version"] == "1"
        for url in urls:
            assert_engine_equals(url, model, "1")

        model = hf_model(tiny_model_dir, seed=2)
        second = sync(run, ws, model, 2)
        assert not second.new_group and "init" not in second.seconds
        assert second.engines == urls and versions(*urls) == ["2", "2"]
        for url in urls:
            assert_engine_equals(url, model, "2")
        # Traffic through the router reaches engines that serve the new version.
        assert served_version(router.url) == "2"

        # Membership changes: a new group for the engines left; the one that left keeps v2.
        headers = {"Authorization": f"Bearer {TOKEN}"}
        httpx.post(f"{router.url}/remove_worker", params={"url": urls[1]}, headers=headers)
        third = sync(run, ws, hf_model(tiny_model_dir, seed=3), 3)
        assert third.new_group == group and third.engines == [urls[0]]
        assert ws.members == ([urls[0]] if group else [])
        assert versions(*urls) == ["3", "2"]
        # It was paused with the members it left (the router was asked at the same time),
        # and continued: it still serves whoever calls it directly.
        assert served_version(urls[1]) == "2"
    finally:
        run(ws.close())
    for engine in engines:
        info = httpx.get(f"{engine.url}/get_server_info").json()
        assert info["weight_update_groups"] == []
    spans = [s for s in exporter.get_finished_spans() if s.name == "trainer.weight_sync"]
    assert [dict(s.attributes or {}) for s in spans] == [
        {
            "millstream.stage": "weight_sync",
            "millstream.version": v,
            "millstream.sync.engine_count": n,
            "millstream.bytes": first.bytes,
            "millstream.buckets": first.buckets,
            "millstream.sync.removed": 0,
        }
        for v, n in ((1, 2), (2, 2), (3, 1))
    ]


def test_an_engine_that_never_answers_is_removed_and_the_rest_synced(
    engines: list[EngineProcess], router_of, hanging_url: str, tiny_model_dir: Path, run
):
    healthy = engines[0].url
    router = router_of(healthy, hanging_url)
    assert sorted(listed(router)) == sorted([healthy, hanging_url])
    timeout_s = 3.0
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=timeout_s, group_name="hang")
    try:
        model = hf_model(tiny_model_dir, seed=3)
        start = time.monotonic()
        report = sync(run, ws, model, 3)
        assert time.monotonic() - start < timeout_s + 10
        assert report.engines == [healthy]
        assert list(report.removed) == [hanging_url]
        assert "no answer within 3 s" in report.removed[hanging_url]
        assert listed(router) == [healthy]
        assert versions(healthy) == ["3"]
        assert_engine_equals(healthy, model, "3")

        model = hf_model(tiny_model_dir, seed=4)
        again = sync(run, ws, model, 4)
        assert again.engines == [healthy] and again.removed == {} and not again.new_group
        assert_engine_equals(healthy, model, "4")

        headers = {"Authorization": f"Bearer {TOKEN}"}
        httpx.post(f"{router.url}/remove_worker", params={"url": healthy}, headers=headers)
        with pytest.raises(MillstreamError, match="no engine left to sync"):
            sync(run, ws, model, 5)
    finally:
        run(ws.close())


def test_a_misfit_engine_on_the_tensor_route_is_removed_and_the_rest_synced(
    engines: list[EngineProcess], router_of, tiny_model_dir: Path, tmp_path: Path, run
):
    """The tensor route's failure: an engine whose model has other shapes refuses the
    bucket; it is removed (not moved to the group: it opened the handle), the rest synced."""
    from tests.support.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", hidden_size=32)
    misfit = EngineProcess(other, tmp_path, "--weight-update-timeout", "10", "--admin-token", TOKEN)
    healthy = engines[1].url
    try:
        router = router_of(healthy, misfit.url)
        ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=5.0, transport="tensor")
        model = hf_model(tiny_model_dir, seed=7)
        try:
            report = sync(run, ws, model, 7)
        finally:
            run(ws.close())
        assert report.engines == [healthy] and list(report.removed) == [misfit.url]
        assert "shapes" in report.removed[misfit.url] and "tensor" in report.seconds
        assert_engine_equals(healthy, model, "7")
        assert versions(misfit.url) == ["default"]
    finally:
        misfit.stop()


def test_an_engine_that_cannot_open_the_shared_bucket_is_served_by_the_group(
    engines: list[EngineProcess], router_of, tiny_model_dir: Path, tmp_path: Path, run
):
    """auto picks the tensor route for an engine on this machine; where the file is not one
    the engine can open (here: not in /dev/shm, as a container with a private /dev/shm would
    see it), that engine gets the same sync through the update group, and later ones too."""
    url = engines[0].url
    router = router_of(url)
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, shm_dir=str(tmp_path))
    try:
        model = hf_model(tiny_model_dir, seed=8)
        first = sync(run, ws, model, 8)
        assert first.engines == [url] and first.removed == {} and ws.members == [url]
        assert {"tensor", "broadcast"} <= set(first.seconds)
        assert_engine_equals(url, model, "8")
        model = hf_model(tiny_model_dir, seed=9)
        second = sync(run, ws, model, 9)
        assert "tensor" not in second.seconds and not second.new_group
        assert_engine_equals(url, model, "9")
    finally:
        run(ws.close())


def test_the_disk_transport_writes_safetensors_the_engines_load(
    engines: list[EngineProcess], router_of, tiny_model_dir: Path, tmp_path: Path, run
):
    """--update-weight-transport disk: each bucket a safetensors file under v{version}/ of a
    directory both sides see, /update_weights_from_disk; only the newest version stays."""
    urls = sorted(e.url for e in engines)
    router = router_of(*urls)
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, bucket_bytes=BUCKET_BYTES,
                    transport="disk", disk_dir=tmp_path / "updates")  # fmt: skip
    try:
        for version, seed in ((31, 10), (32, 11)):
            model = hf_model(tiny_model_dir, seed=seed)
            report = sync(run, ws, model, version)
            assert report.engines == urls and "disk" in report.seconds and ws.members == []
            for url in urls:
                assert_engine_equals(url, model, str(version))
        assert sorted(p.name for p in (tmp_path / "updates").iterdir()) == ["v32"]
        assert len(list((tmp_path / "updates" / "v32").glob("*.safetensors"))) == report.buckets
    finally:
        run(ws.close())


def test_an_engine_failing_mid_broadcast_is_removed_and_the_group_rebuilt(
    engines: list[EngineProcess], router_of, tiny_model_dir: Path, tmp_path: Path, run
):
    """The other engine runs a model of another shape: it joins the group but refuses the
    first bucket, so rank 0's broadcast times out. The same sync must finish for the rest."""
    from tests.support.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", hidden_size=32)
    misfit = EngineProcess(other, tmp_path, "--weight-update-timeout", "10", "--admin-token", TOKEN)
    healthy = engines[1].url
    try:
        router = router_of(healthy, misfit.url)
        ws = WeightSync(
            router.url, admin_token=TOKEN, timeout_s=3.0, group_name="misfit", transport="nccl"
        )
        model = hf_model(tiny_model_dir, seed=5)
        try:
            report = sync(run, ws, model, 5)
        finally:
            run(ws.close())
        assert report.engines == [healthy] and report.attempts == 2
        assert list(report.removed) == [misfit.url]
        assert "shapes" in report.removed[misfit.url]
        assert listed(router) == [healthy]
        assert_engine_equals(healthy, model, "5")
        assert versions(misfit.url) == ["default"]  # never claimed a version it lacks
    finally:
        misfit.stop()


def paused(url: str) -> bool:
    return httpx.get(f"{url}/get_server_info").json()["scheduler"]["paused"]


def test_an_idle_sync_of_one_bucket_neither_pauses_nor_continues_the_engines(
    engines: list[EngineProcess], router_of, tiny_model_dir: Path, run
):
    """Sync mode between rollouts (nothing generates): the update lands between two engine
    steps with its version, so the pause and the continue are two round trips for nothing.
    An engine left paused stays paused (no continue was sent); a sync of several buckets is
    paused and continued even when idle (a step between two buckets would mix versions)."""
    url = engines[0].url
    router = router_of(url)
    one_bucket = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, group_name="idle")
    several = WeightSync(
        router.url, admin_token=TOKEN, timeout_s=20, group_name="idle2", bucket_bytes=BUCKET_BYTES
    )
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        model = hf_model(tiny_model_dir, seed=4)
        report = run(one_bucket.sync(model.named_parameters(), 11, idle=True))
        assert report.buckets == 1 and report.engines == [url] and versions(url) == ["11"]
        assert_engine_equals(url, model, "11")
        assert not paused(url)

        httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, headers=headers)
        model = hf_model(tiny_model_dir, seed=5)
        run(one_bucket.sync(model.named_parameters(), 12, idle=True))
        assert versions(url) == ["12"] and paused(url)  # not continued: it was never paused
        run(one_bucket.sync(model.named_parameters(), 13))  # not idle: paused and continued
        assert versions(url) == ["13"] and not paused(url)

        httpx.post(f"{url}/pause_generation", json={"mode": "abort"}, headers=headers)
        report = run(several.sync(model.named_parameters(), 14, idle=True))
        assert report.buckets > 1 and versions(url) == ["14"] and not paused(url)
        assert_engine_equals(url, model, "14")
    finally:
        run(one_bucket.close())
        run(several.close())


def test_an_idle_sync_gates_the_router_first_and_early_requests_get_the_new_weights(
    engines: list[EngineProcess], router_of, tiny_model_dir: Path, run
):
    """`on_gated`: the trainer hands out the next rollouts while an idle sync ships their
    weights. When it is called the router already serves only the new version, which no
    engine holds yet; a request sent then waits at the router and is generated with the new
    weights. A sync that pauses (not idle) does not call it."""
    url = engines[0].url
    router = router_of(url)
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, group_name="gated")
    early: list[Any] = []
    pool = ThreadPoolExecutor(1)

    def gated() -> None:
        seen = (
            httpx.get(f"{router.url}/get_weight_version").json()["weight_version"],
            versions(url),
        )
        early.append((seen, pool.submit(served_version, router.url)))

    try:
        model = hf_model(tiny_model_dir, seed=6)
        run(ws.sync(model.named_parameters(), 21, idle=True, on_gated=gated))
        ((router_version, engine_versions), request) = early.pop()
        assert router_version == "21" and engine_versions != ["21"]
        assert request.result(timeout=30) == "21"
        assert_engine_equals(url, model, "21")
        run(ws.sync(model.named_parameters(), 22, on_gated=gated))  # pauses: no early start
        assert not early and versions(url) == ["22"]
    finally:
        run(ws.close())
        pool.shutdown()
