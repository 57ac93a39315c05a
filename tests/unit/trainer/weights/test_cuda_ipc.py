"""The CUDA IPC route of the tensor transport (common/tensor_share.py) between two processes, as
the colocated weight sync uses it: the trainer (this test process) flattens a bucket on its GPU
and `share`s it; an engine (a consumer subprocess) `open_bucket`s it, copies, drops its views
and calls `torch.cuda.ipc_collect()`; the trainer `release`s. Checked: the bytes arrive exactly
(sha256 of each tensor's bytes, at offsets no dtype is aligned to), on the producer's GPU found
by its UUID, and the producer's memory comes back after the release. GPU only; the
shared-memory twin runs everywhere (test_weight_transport.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from millstream.common import tensor_share
from millstream.trainer.weights.routes.base import flatten_bytes

pytestmark = pytest.mark.gpu

# The engine's side. It runs with this interpreter and environment, so `millstream` imports
# as it does here (the editable install, or the GPU machine's PYTHONPATH).
CONSUMER = r"""
import hashlib, json, sys
import torch
from millstream.common import tensor_share

def digest(t):
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()

named = tensor_share.open_bucket(sys.stdin.readline())
torch.cuda.synchronize()
print(json.dumps([
    {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
     "sha256": digest(t), "gpu_uuid": str(torch.cuda.get_device_properties(t.device).uuid),
     "index": t.device.index}
    for n, t in named
]), flush=True)
sys.stdin.readline()  # the engine has copied the weights in: it lets go of the shared bytes
del named
torch.cuda.synchronize()
torch.cuda.ipc_collect()
print("dropped", flush=True)
sys.stdin.readline()  # alive until the producer has looked at its memory
"""


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _bucket(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes back to back: after the bf16 [3] the fp32 starts at byte 2_000_006 and the
    int64 at 2_009_330, offsets their dtypes are not aligned to (the receiver copies those)."""
    g = torch.Generator(device=device).manual_seed(0)
    named = [
        ("w", torch.randn(1000, 1000, generator=g, device=device).to(torch.bfloat16)),
        ("b", torch.randn(3, generator=g, device=device).to(torch.bfloat16)),
        ("proj", torch.randn(333, 7, generator=g, device=device)),
        ("ids", torch.randint(-(2**62), 2**62, (17,), generator=g, device=device)),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        named.append(
            ("fp8", torch.randn(5, 11, generator=g, device=device).to(torch.float8_e4m3fn))
        )
    return named


def _settled_allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


class _Consumer:
    """The consumer subprocess, spoken to a line at a time, each answer awaited with a limit."""

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None):
        self.err = tmp_path / "consumer.stderr"
        self._err_file = self.err.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CONSUMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._err_file, text=True, env={**os.environ, **(env or {})},
        )  # fmt: skip

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self, timeout_s: float = 45.0) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()))
        reader.daemon = True
        reader.start()
        reader.join(timeout_s)
        if not box or not box[0]:
            self.proc.kill()
            raise AssertionError(
                f"the consumer gave no answer in {timeout_s:g} s; its stderr:\n"
                f"{self.err.read_text()[-3000:]}"
            )
        return box[0].strip()

    def close(self) -> None:
        """End of input ends the consumer; one that hangs is killed."""
        with contextlib.suppress(BrokenPipeError):  # it died already: its stderr says why
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()
        self._err_file.close()


def _share_bucket(device: torch.device) -> tuple[tensor_share.Shared, str, list[dict], int]:
    """The bucket shared as the trainer shares it (routes/tensor.py `_share_bucket`): the handle,
    the request entry, what the consumer must report, and the bucket's size; nothing of it is
    left referenced here but `shared`."""
    named = _bucket(device)
    flat = flatten_bytes([t for _, t in named])
    torch.cuda.current_stream(device).synchronize()
    shared = tensor_share.share(flat)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    assert shared.handle["gpu_uuid"] == uuid
    entry = tensor_share.bucket_request(
        shared.handle, [n for n, _ in named], [t.dtype for _, t in named],
        [list(t.shape) for _, t in named],
    )  # fmt: skip
    want = [
        {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
         "sha256": _digest(t), "gpu_uuid": uuid}
        for n, t in named
    ]  # fmt: skip
    return shared, entry, want, flat.numel()


def test_a_bucket_crosses_to_another_process_byte_for_byte_and_is_freed_after(tmp_path):
    device = torch.device("cuda", torch.cuda.current_device())
    flatten_bytes([t for _, t in _bucket(device)])  # first-use allocations before the baseline
    base = _settled_allocated()
    shared, entry, want, nbytes = _share_bucket(device)
    assert _settled_allocated() - base >= nbytes  # only the flattened copy is left
    consumer = _Consumer(tmp_path)
    try:
        consumer.send(entry)
        got = json.loads(consumer.line())
        assert [{k: v for k, v in g.items() if k != "index"} for g in got] == want
        # The trainer releases once every engine answered; this one still maps the bytes.
        shared.release()
        assert _settled_allocated() - base >= nbytes
        consumer.send("drop")
        assert consumer.line() == "dropped"
        torch.cuda.ipc_collect()
        assert _settled_allocated() == base, "the shared bucket is still allocated"
    finally:
        consumer.close()
        shared.release()


def test_a_receiver_that_numbers_the_gpus_otherwise_opens_the_producers_gpu(tmp_path):
    """The producer's cuda:1 is the consumer's cuda:0 (CUDA_VISIBLE_DEVICES in the other
    order): the handle's UUID finds it; the index alone would open the other GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in (0, 1)]
    device = torch.device("cuda", 1)
    shared, entry, want, _ = _share_bucket(device)
    consumer = _Consumer(tmp_path, {"CUDA_VISIBLE_DEVICES": f"GPU-{uuids[1]},GPU-{uuids[0]}"})
    try:
        consumer.send(entry)
        got = json.loads(consumer.line())
        assert {g["index"] for g in got} == {0}
        assert [{k: v for k, v in g.items() if k != "index"} for g in got] == want
        consumer.send("drop")
        assert consumer.line() == "dropped"
    finally:
        consumer.close()
        shared.release()


def test_a_handle_for_a_gpu_this_process_does_not_see_is_refused_and_holds_nothing():
    """Refused before anything is opened (the sync then takes the update group), and the
    reference torch counted for this receiver is given back: released, the bytes are freed
    without waiting on a receiver that never opened them."""
    device = torch.device("cuda", torch.cuda.current_device())
    base = _settled_allocated()
    flat = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device=device)
    shared = tensor_share.share(flat)
    del flat
    elsewhere = "GPU-00000000-0000-4000-8000-000000000000"
    with pytest.raises(ValueError, match=f"sees no GPU with UUID {elsewhere}"):
        tensor_share.open_flat({**shared.handle, "gpu_uuid": elsewhere})
    shared.release()
    assert _settled_allocated() == base, "a refused handle kept the producer's bytes"
