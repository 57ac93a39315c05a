"""--colocate's turns on the CPU (weights/colocate.py): their order is observable and asserted.

On the CPU nothing moves (no GPU memory to free), so what these tests watch is the books:
TrainOffload's residency (a real torch backend on the tiny model, its offload copying CPU
tensors as a GPU's would) and the engines' memory as engines answering like
engine/http/control.py hold it. The engines here are recorded stand-ins for WeightSync's
`each_engine`: each call is logged with the trainer's residency at that moment, read from
the offload itself, so the order is checked from outside Colocation as well as by its own
invariant. Reordering the turns (the trainer back on the device before the engines release,
or not offloaded after the sync) fails here. A real engine process takes the same turns in
tests/integration/test_colocate_engine.py; the GPU measures them there and in
tests/unit/trainer/backends/test_colocate_gpu.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from millstream.trainer.backends.offload import TrainOffload
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.trainer import Parts, Trainer
from millstream.trainer.weights.colocate import Colocation, ColocationError
from millstream.trainer.weights.sync import Failure, SyncReport
from tests.unit.trainer.backends.test_bf16 import _cfg, _samples

RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"
BOTH = frozenset({"kv_cache", "weights"})
KV = frozenset({"kv_cache"})
NONE: frozenset[str] = frozenset()


class RecordedEngines:
    """Engines as WeightSync.each_engine reaches them: each holds its released memory tags
    as the scheduler does (a release adds them, a resume takes them off) and answers with
    success; `calls` logs (path, tags, whether the trainer's state was on its device)."""

    def __init__(self, offload: TrainOffload | None, urls: tuple[str, ...] = ("e0", "e1")):
        self.offload = offload
        self.released: dict[str, set[str]] = {url: set() for url in urls}
        self.calls: list[tuple[str, tuple[str, ...], bool]] = []

    def trainer_resident(self) -> bool:
        return self.offload is None or self.offload.resident

    async def each_engine(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for held in self.released.values():
            if path == RELEASE:
                held |= set(body["tags"])
            else:
                held -= set(body["tags"])
        self.calls.append((path, tuple(body["tags"]), self.trainer_resident()))
        return {}

    def kv_resident_with_the_trainer(self) -> bool:
        return self.trainer_resident() and any("kv_cache" not in r for r in self.released.values())


def _iteration(colocation: Colocation, backend: TorchBackend, engines: RecordedEngines, it: int):
    """One iteration as Trainer._train_and_sync runs it, the weight sync read by the test:
    the trainer's weights must be on its device then, and the engines' weights back."""

    async def run() -> list[str]:
        states = []
        await colocation.before_train()
        states.append(engines.kv_resident_with_the_trainer())
        backend.train_rollout(_samples(), 1, it)
        await colocation.before_sync()
        assert engines.trainer_resident(), "the weight sync reads the trainer's weights"
        assert all("weights" not in r for r in engines.released.values())
        await colocation.after_sync()
        states.append(engines.kv_resident_with_the_trainer())
        return states

    return asyncio.run(run())


@pytest.fixture
def backend(tiny_model_dir) -> TorchBackend:
    return TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=4)


def test_the_turns_never_put_the_trainer_and_a_kv_cache_on_the_device_together(backend):
    offload = TrainOffload(backend)
    offload.copies = (
        True  # the CPU copies as a GPU would (tests/unit/trainer/backends/test_colocate.py)
    )
    engines = RecordedEngines(offload)
    colocation = Colocation(engines, offload, release_engines=True)
    asyncio.run(colocation.start())
    assert [(t.name, t.trainer_resident, t.trainer_bytes) for t in colocation.turns] == [
        ("offload", False, 0)
    ]

    for it in range(2):
        engines.calls.clear()
        assert _iteration(colocation, backend, engines, it) == [False, False]
        # Seen by the engines: the trainer's state in host memory when they release and when
        # their KV cache comes back, on the device only while their weights are back for the
        # sync (the engines' weights, not their KV cache).
        assert engines.calls == [
            (RELEASE, ("kv_cache", "weights"), False),
            (RESUME, ("weights",), True),
            (RESUME, ("kv_cache",), False),
        ]
        turns = colocation.turns
        assert [(t.name, t.trainer_resident, t.released) for t in turns] == [
            ("release", False, BOTH),
            ("onload", True, BOTH),
            ("resume weights", True, KV),
            ("offload", False, KV),
            ("resume kv_cache", False, NONE),
        ]
        # The books: nothing on the device in host-memory turns; after the step, the state
        # onloaded plus the gradients (and, after the first step, Adam's new moments).
        on = [t.trainer_bytes for t in turns]
        assert on[0] == on[3] == on[4] == 0
        assert on[2] == offload.last.nbytes + offload.last.dropped > on[1] > 0
        assert colocation.seconds == pytest.approx(sum(t.seconds for t in turns))


class OnloadFirst(Colocation):
    """The reordering of issue 40: the trainer back on the device before the engines release."""

    async def before_train(self) -> None:
        self.turns = []
        await self._trainer("onload", self.offload.to_device)
        await self._engines("release", RELEASE, ["kv_cache", "weights"])


class NoOffloadAfterSync(Colocation):
    """The other half: the engines' KV cache back with the trainer's state still there."""

    async def after_sync(self) -> None:
        await self._engines("resume kv_cache", RESUME, ["kv_cache"])
        self._check_end()


@pytest.mark.parametrize(
    ("variant", "turn"),
    [(OnloadFirst, "onload"), (NoOffloadAfterSync, "resume kv_cache")],
    ids=["onload-before-release", "no-offload-after-sync"],
)
def test_a_turn_order_that_shares_the_device_is_an_error(backend, variant, turn):
    offload = TrainOffload(backend)
    engines = RecordedEngines(offload)
    colocation = variant(engines, offload, release_engines=True)
    asyncio.run(colocation.start())
    with pytest.raises(ColocationError, match=f"after the turn '{turn}: the trainer's state on"):
        _iteration(colocation, backend, engines, 0)
    assert engines.kv_resident_with_the_trainer()  # what the error stopped


@pytest.mark.parametrize("offload_train", [True, False], ids=["train", "no-offload-train"])
def test_with_one_offload_off_the_turns_are_recorded_and_the_iteration_ends_in_place(
    backend, offload_train
):
    """--no-offload-train or --no-offload-rollout: the user chose to share the device, so the
    invariant is not checked, but every iteration still ends with what is offloaded in host
    memory and the engines whole."""
    offload = TrainOffload(backend) if offload_train else None
    engines = RecordedEngines(offload)
    colocation = Colocation(engines, offload, release_engines=not offload_train)
    asyncio.run(colocation.start())
    _iteration(colocation, backend, engines, 0)
    if offload_train:
        assert [(t.name, t.trainer_resident) for t in colocation.turns] == [
            ("onload", True),
            ("offload", False),
        ]
        assert engines.calls == []
    else:
        assert [(t.name, t.trainer_bytes, t.released) for t in colocation.turns] == [
            ("release", None, BOTH),
            ("resume weights", None, KV),
            ("resume kv_cache", None, NONE),
        ]


def test_an_engine_that_fails_a_turn_stops_the_run_with_its_name(backend):
    class Failing(RecordedEngines):
        async def each_engine(self, path, body):
            await super().each_engine(path, body)
            return {"http://e1": Failure("HTTP 500: out of memory", 0.1)}

    colocation = Colocation(Failing(None), None, release_engines=True)
    with pytest.raises(Exception, match=r"release_memory_occupation.*http://e1: HTTP 500"):
        asyncio.run(colocation.before_train())


# -- the trainer's own step -------------------------------------------------------------------


class RecordedSync(RecordedEngines):
    """The WeightSync surface Trainer._train_and_sync reaches (through its EngineKeeper) with
    recorded engines: `sync` reads the weights as the real one does, and records where the
    trainer's state and the engines' weights were at that read."""

    def __init__(self, offload: TrainOffload | None):
        super().__init__(offload)
        self.reads: list[tuple[bool, bool, int]] = []  # (trainer on device, engine weights back,
        # tensors read)

    async def revivable(self, *, eager: bool = False) -> list[str]:
        return []

    async def sync(self, weights: Any, version: int, *, join=(), **kwargs: Any) -> Any:
        tensors = list(weights())
        back = all("weights" not in r for r in self.released.values())
        self.reads.append((self.trainer_resident(), back, len(tensors)))
        return SyncReport(engines=list(self.released), version=version)


def test_the_trainers_own_step_syncs_between_its_turns(backend):
    """Trainer._train_and_sync itself under --colocate, not a replay of its order: the step's
    sync reads the trainer's weights while its state is on the device and the engines'
    weights are back, and the iteration ends in the colocated state. Moving a turn in the
    trainer (after_sync before the sync: the sync then reads weights already offloaded) fails
    here, by the colocation's own check and by this sync's record."""
    offload = TrainOffload(backend)
    offload.copies = True
    engines = RecordedSync(offload)
    colocation = Colocation(engines, offload, release_engines=True)
    parts = Parts(
        backend=backend,
        admission=SimpleNamespace(in_flight={}),
        buffer=SimpleNamespace(ready=0),
        weight_sync=engines,
        evaluator=None,
        logger=None,
        colocation=colocation,
    )
    trainer = Trainer(_cfg(), parts, num_rollout=2)

    async def two_steps() -> list[dict[str, Any]]:
        await colocation.start()
        out = []
        for it in (1, 2):
            train, _, report = await trainer._train_and_sync(it, _samples(), [], 2)
            assert report.version == it and trainer.version == it
            out.append(train)
        return out

    for train in asyncio.run(two_steps()):
        assert train["grad_norm"] > 0
    n_weights = len(list(backend.named_weights()))
    assert engines.reads == [(True, True, n_weights)] * 2
    assert [t.name for t in colocation.turns] == [
        "release", "onload", "resume weights", "offload", "resume kv_cache",
    ]  # fmt: skip
    assert not offload.resident and engines.released == {"e0": set(), "e1": set()}


def test_a_sync_outside_its_turns_is_an_error(backend):
    """The colocation's check of the sync's read (Colocation.sync_source), on the CPU where
    nothing moves: after the offload, and before the engines' weights are back."""
    offload = TrainOffload(backend)
    engines = RecordedSync(offload)
    colocation = Colocation(engines, offload, release_engines=True)
    read = colocation.sync_source(backend.named_weights)

    async def run() -> None:
        await colocation.start()
        with pytest.raises(ColocationError, match="while its state is in host memory"):
            read()
        await colocation.before_train()
        with pytest.raises(ColocationError, match="while the engines' weights are released"):
            read()
        await colocation.before_sync()
        assert len(list(read())) > 0

    asyncio.run(run())
