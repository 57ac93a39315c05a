"""The trainer's offload measured on a GPU (backends/offload.py; `make gpu-check` runs these).

What the CPU tests can only book-keep (tests/unit/trainer/backends/test_colocate.py), measured here: at
`to_host` the trainer's allocations on the device fall by the bytes the offload says it moved
plus the gradients it dropped, and the allocator's cache goes back to the driver; at
`to_device` they come back by the bytes moved; the host side is pinned and kept across
offloads; and the steps after the round trips are the steps of a backend never offloaded.
With an engine on the same GPU: tests/integration/test_colocate_engine.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

from millstream.trainer.backends.offload import TrainOffload
from millstream.trainer.backends.torch_backend import TorchBackend
from tests.support.tiny_model import build_tiny_model
from tests.unit.trainer.backends.test_bf16 import _cfg, _samples

pytestmark = pytest.mark.gpu

MiB = 2**20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """About 19M parameters: with fp32 Adam, some 300 MiB of trainer state, enough to see
    above the allocator's rounding and the CUDA context."""
    return build_tiny_model(tmp_path_factory.mktemp("offload-gpu"), hidden_size=1024, num_layers=2)


def _near(got: int, want: int, what: str, rel: float = 0.03, slack: int = 8 * MiB) -> None:
    assert abs(got - want) <= rel * want + slack, (
        f"{what}: {got / MiB:.1f} MiB, want {want / MiB:.1f}"
    )


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("flags", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_offload_frees_the_device_and_training_goes_on(model_dir, flags):
    # The steps of a backend never offloaded, first and alone: two backends sharing the
    # allocator's segments would blur what one of them gives back.
    plain = TorchBackend(_cfg(*flags), model_dir, ref_dir=None, total_steps=4)
    want = [plain.train_rollout(_samples(), 1, it) for it in range(3)]
    del plain
    gc.collect()
    torch.cuda.empty_cache()

    moved = TorchBackend(_cfg(*flags), model_dir, ref_dir=None, total_steps=4)
    assert moved.device.type == "cuda"
    offload = TrainOffload(moved)
    assert offload.copies
    params = list(moved.model.parameters())
    host_ptrs: list[int] = []
    for it in range(3):
        got = moved.train_rollout(_samples(), 1, it)
        # The same steps, up to the order of atomic adds in some backward kernels.
        for name in ("loss", "grad_norm"):
            assert got[name] == pytest.approx(want[it][name], rel=1e-2, abs=1e-4), (it, name)
        assert got["grad_norm"] > 0
        if it == 2:
            break

        before, reserved = _allocated(), torch.cuda.memory_reserved()
        allocations = offload.host_allocations
        away = offload.to_host()
        after = _allocated()
        assert away.nbytes > 100 * MiB and away.dropped > 50 * MiB  # Adam's moments; grads
        _near(before - after, away.nbytes + away.dropped, "to_host freed")
        # The cache goes back to the driver: an engine could take it now.
        assert reserved - torch.cuda.memory_reserved() >= 0.9 * (away.nbytes + away.dropped)
        assert torch.cuda.memory_reserved() - after < 64 * MiB
        assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
        ptrs = [p.data_ptr() for p in params]
        if it == 0:
            host_ptrs = ptrs
        else:  # the pinned buffers of the first offload, reused
            assert ptrs == host_ptrs and offload.host_allocations == allocations

        back = offload.to_device()
        assert back.nbytes == away.nbytes and back.dropped == 0
        _near(_allocated() - after, back.nbytes, "to_device brought")
        assert all(p.device == moved.device and p.grad is None for p in params)
        if moved.master is not None:
            assert all(m.device == moved.device for m in moved.master.params)
