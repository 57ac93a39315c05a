"""Weight sync without servers: how tensors are cut into buckets, what each bucket announces
to the engines, and who is blamed when a step of the update group breaks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from millstream.common.config import parse_run_config
from millstream.engine.weights import unflatten_bytes
from millstream.trainer.build import master_address
from millstream.trainer.weights.coordinator import host_address
from millstream.trainer.weights.routes.base import flatten_bytes, plan_buckets
from millstream.trainer.weights.routes.process_group import backend_for
from millstream.trainer.weights.sync import Failure, GroupBroken, WeightSync


def named(*sizes: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]


def test_buckets_keep_order_and_stay_under_the_limit_unless_one_tensor_is_bigger():
    buckets = plan_buckets(named(10, 10, 10, 50, 5, 5), max_bytes=80)  # float32: 4 bytes each
    assert [b.names for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [b.nbytes for b in buckets] == [80, 40, 200, 40]
    assert plan_buckets([], max_bytes=80) == []


def test_a_flattened_bucket_reads_back_exactly_whatever_the_dtypes_and_offsets():
    """The trainer's flattened_bucket bytes, read by the engine's side: mixed dtypes put a
    float32 at an odd byte offset (3 bfloat16 = 6 bytes), which a plain view would refuse."""
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("b", torch.randn(2, 5, generator=g)),
        ("c", torch.randn(4, 1, generator=g).to(torch.float16)),
        ("d", torch.randn(3, 4, generator=g).t()),  # not contiguous
    ]
    flat = flatten_bytes([t for _, t in tensors])
    assert flat.dtype == torch.uint8 and flat.numel() == 6 + 40 + 8 + 48
    specs = [(n, t.dtype, list(t.shape)) for n, t in tensors]
    back = unflatten_bytes(flat, specs)
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(tensors, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # Pieces at an offset their item size divides are views of the received bytes (a 25 MB
    # model's sync copied them all once more); "b" (offset 6) and "d" (54) are copies.
    shared = [
        got.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for _, got in back
    ]
    assert shared == [True, False, True, False]
    with pytest.raises(Exception, match="too few"):
        unflatten_bytes(flat[:-1], specs)


def test_bucket_spec_is_the_update_request_body():
    tensors = [("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    (bucket,) = plan_buckets(tensors, max_bytes=1 << 20)
    assert bucket.spec() == {
        "names": ["a", "b"],
        "dtypes": ["bfloat16", "float32"],
        "shapes": [[2, 3], [4]],
    }


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'t0' appears twice"):
        plan_buckets(named(1) + named(1), max_bytes=8)
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan_buckets(named(1), max_bytes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        WeightSync("http://router", timeout_s=0)
    # A route's other spelling is the config's to resolve; here it would have run as auto.
    with pytest.raises(ValueError, match="'group' is not auto or one of"):
        WeightSync("http://router", transport="group")
    with pytest.raises(ValueError, match="disk_dir"):
        WeightSync("http://router", transport="disk")


def test_backend_follows_the_tensors_device():
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "nccl"


class Probe:
    """Stands in for the engines' /health: only `alive` ones answer."""

    def __init__(self, *alive: str):
        self._alive = set(alive)

    async def alive(self, urls: list[str]) -> set[str]:
        return {u for u in urls if u in self._alive}


def blame(probe: Probe, rank0: Exception | None, failed: dict[str, Failure]) -> dict[str, str]:
    ws = WeightSync("http://router", timeout_s=10)
    broken = GroupBroken("/update_weights_from_distributed", rank0, failed)
    return asyncio.run(ws._group.blame(probe, broken, ["a", "b", "c"]))  # type: ignore[arg-type]


def test_blame_dead_engines_first():
    failed = {"a": Failure("no answer within 10 s", 10.0), "b": Failure("reset", 0.1)}
    got = blame(Probe("b", "c"), RuntimeError("timed out"), failed)
    assert list(got) == ["a"] and "no answer to /health" in got["a"]


def test_blame_the_failures_when_rank0_or_another_engine_succeeded():
    failed = {"b": Failure("shapes: ...", 10.0)}
    assert list(blame(Probe("a", "b", "c"), RuntimeError("timed out"), failed)) == ["b"]
    assert list(blame(Probe("a", "b", "c"), None, failed)) == ["b"]


def test_blame_early_quitters_when_everyone_failed():
    failed = {
        "a": Failure("HTTP 400: shapes: ...", 0.05),
        "b": Failure("no answer within 10 s", 10.0),
        "c": Failure("no answer within 10 s", 10.0),
    }
    assert list(blame(Probe("a", "b", "c"), RuntimeError("timed out"), failed)) == ["a"]


def test_blame_nobody_when_everyone_failed_alike():
    slow = {u: Failure("timed out", 9.9) for u in "abc"}
    fast = {u: Failure("nccl needs CUDA", 0.01) for u in "abc"}
    assert blame(Probe("a", "b", "c"), RuntimeError("timed out"), slow) == {}
    assert blame(Probe("a", "b", "c"), RuntimeError("timed out"), fast) == {}


def test_the_rendezvous_address_is_loopback_only_when_the_router_is():
    """Engines in other containers cannot reach 127.0.0.1 (the first real compose run)."""

    def address(*flags: str) -> str:
        return master_address(parse_run_config(["--rollout-batch-size", "2", *flags], mode="sync"))

    assert address("--router-url", "http://127.0.0.1:8000") == "127.0.0.1"
    assert address("--router-url", "http://localhost:8000") == "127.0.0.1"
    assert address() == "127.0.0.1"  # the launcher starts the router on loopback
    assert address("--router-url", "http://router:30000") == host_address()
    explicit = ("--router-url", "http://router:30000", "--weight-sync-master-address", "10.0.0.7")
    assert address(*explicit) == "10.0.0.7"


class Refusing:
    """Engines that answer an init with an error at once (they will never join)."""

    async def each(self, urls: list[str], path: str, body) -> dict[str, Failure]:
        return {u: Failure("HTTP 400: backend gloo is not available", 0.01) for u in urls}


def test_rank0_stops_waiting_for_a_rendezvous_an_engine_refused():
    """Rank 0 would wait its whole timeout for an engine that refused to join: the
    rendezvous step gives up at once (its thread ends on its own); a broadcast never does."""
    ws = WeightSync("http://router", timeout_s=10)
    rank0_done = threading.Event()

    def rendezvous() -> None:
        rank0_done.wait(1.0)

    async def step(early_out: bool) -> float:
        start = time.monotonic()
        with pytest.raises(GroupBroken) as broken:
            await ws._group.step(Refusing(), "/init", ["a"], lambda i, u: {}, rendezvous,
                                 early_out=early_out)  # type: ignore[arg-type]  # fmt: skip
        assert list(broken.value.failed) == ["a"]
        return time.monotonic() - start

    assert asyncio.run(step(early_out=True)) < 0.5
    assert asyncio.run(step(early_out=False)) >= 0.9
    rank0_done.set()
