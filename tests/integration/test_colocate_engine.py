"""--colocate's turns against a real engine process (weights/colocate.py): the trainer's
offload from a real torch backend, the engine's releases and resumes over HTTP, and, at every
turn, what each side says of itself: the trainer's residency (TrainOffload) and the memory
the engine reports released (/get_server_info). The engines are reached here without a router:
`HttpEngines` stands in for WeightSync.each_engine (POST to each engine, failures by URL).

On the CPU this checks the turns' order as both processes see it. On a GPU
(`@pytest.mark.gpu`) it measures them too: the device's free memory rises by what the engine
says it released and falls by its KV cache at the last resume; the trainer's own allocations
rise and fall by what its offload says it moved; and at no turn does the trainer hold its
state on the device while the engine holds its KV cache. The trainer's side alone, on a GPU:
tests/unit/trainer/backends/test_colocate_gpu.py; the order alone, fast: tests/unit/trainer/test_colocate_turns.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from millstream.trainer.backends.offload import TrainOffload
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.weights.colocate import Colocation
from millstream.trainer.weights.sync import Failure
from tests.support.engine_proc import EngineProcess
from tests.support.tiny_model import build_tiny_model
from tests.unit.trainer.backends.test_bf16 import _cfg, _samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@dataclass
class Seen:
    """One engine call, or a point between turns (`path` None), as the test saw it."""

    turn: str
    path: str | None
    trainer_resident: bool
    engine_released: frozenset[str]  # the engine's /get_server_info after the call
    answer: dict[str, int] = field(default_factory=dict)  # the bytes it answered, by tag
    probe: dict[str, int] = field(default_factory=dict)  # `probe()` after the call
    probe_before: dict[str, int] = field(default_factory=dict)


class HttpEngines:
    """WeightSync.each_engine for one engine without a router (module docstring), recording
    each call as `Seen`; `probe` (the GPU test's memory readings) is read around each."""

    def __init__(self, url: str, offload: TrainOffload, probe: Callable[[], dict[str, int]]):
        self.url, self.offload, self.probe = url, offload, probe
        self.http = httpx.Client(timeout=60)
        self.seen: list[Seen] = []

    def released(self) -> frozenset[str]:
        info = self.http.get(self.url + "/get_server_info").json()
        return frozenset(info["scheduler"]["memory_released"])

    async def each_engine(self, path: str, body: dict[str, Any]) -> dict[str, Failure]:
        before = self.probe()
        resp = self.http.post(self.url + path, json=body)
        if resp.status_code != 200 or not resp.json().get("success"):
            return {self.url: Failure(f"HTTP {resp.status_code}: {resp.text[:300]}", 0.0)}
        tags = body["tags"]
        turn = "release" if path == "/release_memory_occupation" else f"resume {' '.join(tags)}"
        self.seen.append(
            Seen(turn, path, self.offload.resident, self.released(), resp.json()["bytes"],
                 self.probe(), before)
        )  # fmt: skip
        return {}

    def between(self, turn: str) -> Seen:
        seen = Seen(turn, None, self.offload.resident, self.released(), probe=self.probe())
        self.seen.append(seen)
        return seen

    def sync(self, backend: TorchBackend, directory: Path) -> None:
        """The weight sync, by the route that needs no update group: the trainer's weights as
        a safetensors file, /update_weights_from_disk (the engine's resumed weights are
        uninitialized until an update has written them all)."""
        directory.mkdir(exist_ok=True)
        weights = {n: t.detach().cpu().contiguous() for n, t in backend.named_weights()}
        save_file(weights, directory / "model.safetensors")
        body = {"model_path": str(directory), "weight_version": "trained"}
        resp = self.http.post(self.url + "/update_weights_from_disk", json=body)
        assert resp.status_code == 200 and resp.json()["success"], resp.text

    def generate(self) -> dict[str, Any]:
        body = {"input_ids": list(b"turns"), "sampling_params": {"max_new_tokens": 4}}
        resp = self.http.post(self.url + "/generate", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()


def _iterate(
    colocation: Colocation, backend: TorchBackend, engines: HttpEngines, it: int, tmp: Path
) -> dict[str, float]:
    """One iteration as Trainer._train_and_sync runs it, observed between its turns (the
    weight sync's transports are tests/integration/test_weight_sync.py's)."""

    async def run() -> dict[str, float]:
        await colocation.before_train()
        engines.between("trained")  # the step runs in this state
        metrics = backend.train_rollout(_samples(), 1, it)
        engines.between("stepped")
        await colocation.before_sync()
        engines.between("sync")  # the weight sync runs in this state
        engines.sync(backend, tmp / "sync")
        await colocation.after_sync()
        engines.between("generate")
        return metrics

    return asyncio.run(run())


def _check_the_turns(colocation: Colocation, engines: HttpEngines, kv: str = "kv_cache"):
    """Both sides' accounts agree, and the trainer's state and the engine's KV cache are
    never on the device together, as the engine itself reports its memory."""
    calls = [s for s in engines.seen if s.path is not None]
    assert [c.turn for c in calls] == ["release", "resume weights", "resume kv_cache"]
    mine = {t.name: t for t in colocation.turns}
    for call in calls:
        assert call.engine_released - {"cuda_graph"} == mine[call.turn].released, call
        assert call.trainer_resident == mine[call.turn].trainer_resident, call
    for seen in engines.seen:
        assert not (seen.trainer_resident and kv not in seen.engine_released), seen
    assert [(s.turn, s.trainer_resident) for s in engines.seen if s.path is None] == [
        ("trained", True), ("stepped", True), ("sync", True), ("generate", False),
    ]  # fmt: skip
    assert engines.seen[-1].engine_released == frozenset()


def test_the_turns_against_a_real_engine(tiny_model_dir, tmp_path):
    backend = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=4)
    offload = TrainOffload(backend)
    offload.copies = (
        True  # on the CPU: copy as a GPU would (tests/unit/trainer/backends/test_colocate.py)
    )
    engine = EngineProcess(tiny_model_dir, tmp_path, "--max-running-requests", "4")
    engines = HttpEngines(engine.url, offload, probe=dict)
    try:
        colocation = Colocation(engines, offload, release_engines=True)
        asyncio.run(colocation.start())
        for it in range(2):
            engines.seen.clear()
            metrics = _iterate(colocation, backend, engines, it, tmp_path)
            assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
            _check_the_turns(colocation, engines)
            assert engines.generate()["meta_info"]["completion_tokens"] == 4
    finally:
        engines.http.close()
        engine.stop()


# -- on a GPU: the same turns, measured ----------------------------------------------------------

MiB = 2**20


def _near(got: int, want: int, what: str, rel: float = 0.03, slack: int = 8 * MiB) -> None:
    """`got` within `rel` of `want` plus `slack`: the allocator rounds each block up, and
    the CUDA context and cuBLAS workspace do not move with the turns."""
    assert abs(got - want) <= rel * want + slack, (
        f"{what}: {got / MiB:.1f} MiB, want {want / MiB:.1f}"
    )


@pytest.mark.gpu
def test_the_turns_measured_on_the_gpu(tmp_path):
    """A model large enough to see (about 38M parameters: with --bf16 about 0.5 GiB of trainer
    state after a step, and a 512 MiB KV pool for the engine), on one GPU with its engine."""
    model = build_tiny_model(tmp_path / "model", hidden_size=1024, num_layers=4)
    backend = TorchBackend(_cfg("--bf16"), model, ref_dir=None, total_steps=4)
    assert backend.device.type == "cuda"
    offload = TrainOffload(backend)

    def probe() -> dict[str, int]:
        torch.cuda.synchronize()
        return {
            "free": torch.cuda.mem_get_info()[0],
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
        }

    # 64 requests x 1024 tokens: 2 x 4 layers x 64 x 2 heads x 1024 x 256 x 2 B = 512 MiB.
    engine = EngineProcess(
        model, tmp_path, "--device", "cuda", "--max-total-tokens", "65536",
        "--disable-cuda-graph", startup_timeout_s=90,
    )  # fmt: skip
    engines = HttpEngines(engine.url, offload, probe)
    try:
        colocation = Colocation(engines, offload, release_engines=True)
        asyncio.run(colocation.start())
        start = probe()  # the trainer offloaded: its context's buffers only
        floor, end = start["reserved"], start["allocated"]
        for it in range(2):
            engines.seen.clear()
            metrics = _iterate(colocation, backend, engines, it, tmp_path)
            assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
            _check_the_turns(colocation, engines)
            by = {s.turn: s for s in engines.seen}
            release, resume_kv = by["release"], by["resume kv_cache"]

            # The engine: its release frees what it answers, its KV cache comes back last.
            assert release.answer.get("kv_cache", 0) >= 500 * MiB, release.answer
            freed = sum(release.answer.values())
            assert release.probe["free"] - release.probe_before["free"] >= 0.9 * freed
            kv = resume_kv.answer["kv_cache"]
            assert resume_kv.probe_before["free"] - resume_kv.probe["free"] >= 0.9 * kv

            # The trainer's moves: what its books say moved is what reached or left the device
            # (the first step adds Adam's moments, so the offload carries more than the onload).
            onload = next(t for t in colocation.turns if t.name == "onload").trainer_bytes
            assert onload is not None and onload > 150 * MiB
            _near(by["trained"].probe["allocated"] - end, onload, "the onload brought")
            state, dropped = offload.last.nbytes, offload.last.dropped
            assert state > 400 * MiB and dropped > 100 * MiB  # Adam; the masters' fp32 grads
            stepped, end = by["stepped"].probe["allocated"], by["generate"].probe["allocated"]
            _near(stepped - end, state + dropped, "the offload freed")

            # What the trainer holds from the driver while the engine's KV cache is there:
            # nothing beyond its floor (which the step's cuBLAS workspace may raise a little).
            assert by["trained"].probe["reserved"] - floor > 0.9 * onload
            for s in (release, resume_kv, by["generate"]):
                assert s.probe["reserved"] - floor < state / 4, (s.turn, s.probe, floor)
            floor = max(floor, by["generate"].probe["reserved"])

        # After the round trips the trainer still trains, and the engine generates.
        before = [p.detach().cpu().clone() for p in backend.model.parameters()]
        asyncio.run(colocation.before_train())
        metrics = backend.train_rollout(_samples(), 1, 2)
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        after = [p.detach().cpu() for p in backend.model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        asyncio.run(colocation.before_sync())
        engines.sync(backend, tmp_path / "sync")
        asyncio.run(colocation.after_sync())
        assert engines.generate()["meta_info"]["completion_tokens"] == 4
    finally:
        engines.http.close()
        engine.stop()
