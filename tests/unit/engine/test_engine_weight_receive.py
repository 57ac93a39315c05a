"""The engine's side of a weight update, below the HTTP routes (engine/weights.py): where a
broadcast bucket lands, and which parameters an update reports as written.

A real gloo group is exercised end to end by tests/integration/test_engine_weights.py; here a
stand-in process group fills the tensors it is handed, so the receive can be checked on any
device: on `meta` (no data at all) a `.cpu()` anywhere would raise, which proves a bucket
stays on the group's device, as an nccl bucket must stay on the engine's GPU.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from millstream.engine.quant import fp8
from millstream.engine.scheduler import RequestError
from millstream.engine.weights import UpdateGroups, WeightLoader, _Group, receive_broadcast

TIMEOUT = timedelta(seconds=5)
SPECS = [  # mixed dtypes: the bf16 after the 3-byte-aligned uint8 sits at an odd offset
    ("a", torch.float32, [2, 3]),
    ("b", torch.uint8, [3]),
    ("c", torch.bfloat16, [4]),
    ("d", torch.float32, [1]),
]


class _Done:
    def wait(self, timeout: timedelta) -> bool:
        return True


class SourcePG:
    """A process group whose rank 0 broadcasts `sent`, one tensor per call, in order."""

    def __init__(self, sent: list[torch.Tensor]):
        self.sent = list(sent)
        self.devices: list[torch.device] = []

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        (tensor,) = tensors
        assert opts.rootRank == 0
        self.devices.append(tensor.device)
        if tensor.device.type != "meta":
            tensor.copy_(self.sent.pop(0).view(tensor.dtype).reshape(tensor.shape))
        return _Done()


def _values() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(d) if d.is_floating_point else
            torch.randint(0, 255, s, generator=gen, dtype=d) for _, d, s in SPECS]  # fmt: skip


def _flat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).view(torch.uint8) for v in values])


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_a_bucket_is_received_on_the_groups_device_and_stays_there(flattened: bool):
    """On `meta` every tensor comes back on meta with its dtype and shape: nothing copied it
    to host memory (a meta tensor's .cpu() raises)."""
    pg = SourcePG([])
    out = receive_broadcast(pg, SPECS, torch.device("meta"), flattened, TIMEOUT)
    assert [n for n, _ in out] == [n for n, _, _ in SPECS]
    for (_, tensor), (_, dtype, shape) in zip(out, SPECS, strict=True):
        assert tensor.device.type == "meta" and tensor.dtype == dtype
        assert list(tensor.shape) == shape
    assert set(pg.devices) == {torch.device("meta")}
    assert len(pg.devices) == (1 if flattened else len(SPECS))


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_a_bucket_received_on_the_cpu_holds_the_senders_values(flattened: bool):
    values = _values()
    pg = SourcePG([_flat(values)] if flattened else values)
    out = receive_broadcast(pg, SPECS, torch.device("cpu"), flattened, TIMEOUT)
    for (_, got), want in zip(out, values, strict=True):
        assert torch.equal(got, want)


class StuckPG:
    """A group whose rank 0 never sends: each broadcast waits until `release` (or times out)."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> StuckPG:
        self.entered.release()
        return self

    def wait(self, timeout: timedelta) -> bool:
        if not self.release.wait(timeout.total_seconds()):
            raise RuntimeError("timed out")
        return True


def _receiving(groups: UpdateGroups, name: str) -> threading.Thread:
    names = [n for n, _, _ in SPECS]
    dtypes = [str(d).removeprefix("torch.") for _, d, _ in SPECS]
    args = (name, names, dtypes, [s for _, _, s in SPECS], True)
    thread = threading.Thread(target=groups.receive, args=args, daemon=True)
    thread.start()
    return thread


def test_a_receive_stuck_in_an_abandoned_group_holds_up_that_group_only():
    """A trainer whose rank 0 timed out behind a network partition rebuilds its group and
    leaves the engine's receive in the old one waiting until --weight-update-timeout. The new
    group's receive goes through meanwhile (with one lock for all groups it waited, the next
    sync timed out twice and the trainer gave up: make chaos-net's only-engine scenario); a
    second receive in the old group still waits for the first."""
    groups = UpdateGroups(5, torch.device("cpu"))
    stuck = StuckPG()
    groups._groups["old"] = _Group(stuck, 1, 2, torch.device("cpu"), TIMEOUT)
    groups._groups["new"] = _Group(SourcePG([_flat(_values())]), 1, 2, torch.device("cpu"), TIMEOUT)
    first = _receiving(groups, "old")
    assert stuck.entered.acquire(timeout=5)
    second = _receiving(groups, "old")
    _receiving(groups, "new").join(timeout=5)
    assert second.is_alive() and not stuck.entered.acquire(timeout=0.2)
    assert groups._groups["new"].pg.sent == []  # the new group's bucket was received
    stuck.release.set()
    first.join(timeout=5)
    second.join(timeout=5)
    assert not first.is_alive() and not second.is_alive()


def test_an_nccl_group_needs_an_engine_on_a_gpu():
    groups = UpdateGroups(5, torch.device("cpu"))
    with pytest.raises(RequestError, match="nccl needs CUDA and this engine runs on cpu"):
        groups.init("127.0.0.1", 1, 0, 2, "g", "nccl")


class Tiny(torch.nn.Module):
    """Tied embedding and head, one plain Linear, one FP8 Linear (fp8.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 16)
        self.head = torch.nn.Linear(16, 8, bias=False)
        self.head.weight = self.embed.weight
        self.plain = torch.nn.Linear(16, 16)
        q, scale_inv = fp8.quantize(torch.randn(16, 16))
        self.quantized = fp8.Fp8Linear(q, scale_inv, None)


def test_an_update_reports_every_parameter_it_wrote():
    """What makes released-then-resumed weights valid again (model_runner.py): a tied
    parameter is written under either of its names, an FP8 weight writes its scales too."""
    model = Tiny().requires_grad_(False)
    loader = WeightLoader(model)
    ids = lambda params: {id(p) for p in params}  # noqa: E731

    written = loader.copy_in([("head.weight", torch.ones(8, 16))])
    assert ids(written) == {id(model.embed.weight)}
    assert torch.equal(model.embed.weight, torch.ones(8, 16))

    full = [("plain.weight", torch.zeros(16, 16)), ("quantized.weight", torch.randn(16, 16))]
    written = loader.copy_in(full)
    assert ids(written) == ids(
        [model.plain.weight, model.quantized.weight, model.quantized.weight_scale_inv]
    )
    q, scale_inv = fp8.quantize(torch.randn(16, 16))
    quantized = [("quantized.weight", q), ("quantized.weight_scale_inv", scale_inv)]
    written = loader.copy_in(quantized)
    assert ids(written) == ids([model.quantized.weight, model.quantized.weight_scale_inv])
    assert torch.equal(model.quantized.weight_scale_inv, scale_inv)
