"""The tensor route to a real SGLang server (routes/sglang_format.py), judged by SGLang's own code.

The trainer's side runs as it does in a sync (`push_sglang`: SGLang's FlattenedTensorBucket,
its MultiprocessingSerializer, one payload per TP rank, the body of each bucket); each body
must pass SGLang's UpdateWeightsFromTensorReqInput whole (sglang_server.admin_problems), and
each rank's payload, decoded in ANOTHER process as SGLang's scheduler does it
(`normalize_serialized_named_tensor_payload`, `monkey_patch_torch_reductions`,
`MultiprocessingSerializer.deserialize`, `FlattenedTensorBucket(...).reconstruct_tensors()`),
must give the trainer's named tensors bit for bit. CPU tensors travel as shared memory opened
by name (torch's `file_system` strategy, which any process on the machine can open: the
default, file descriptors fetched over a socket that checks this process's authkey, is what
a real SGLang server cannot open, and dies of); on a GPU (`gpu` mark) as CUDA IPC handles,
the device written as the GPU's UUID. The decoder is an unrelated process, as the server is.

Broken variants show the check can fail: a tensor's metadata offsets shifted by 8 bytes (what
a wrong layout on our side would do), and one serialization handed to both ranks (each rank
must get its own: CUDA IPC's reference counts).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from millstream.trainer.weights.routes import sglang_format
from millstream.trainer.weights.routes.base import plan_buckets
from tests.contract.sglang_server import admin_problems, digest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
URL = "http://sglang-on-the-trainers-gpu"
TP = 2
BUCKET_BYTES = 128  # two buckets below, mixed dtypes in each

# SGLang's scheduler side of /update_weights_from_tensor, one JSON line in, one out.
DECODER = r"""
import hashlib, json, sys, warnings
warnings.simplefilter("ignore")
import torch
from sglang.srt.utils.common import (
    MultiprocessingSerializer, normalize_serialized_named_tensor_payload)
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

def digest(t):
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(data).hexdigest()]

print("ready", flush=True)
for line in sys.stdin:
    ranks = []
    for entry in json.loads(line)["serialized_named_tensors"]:
        try:
            monkey_patch_torch_reductions()  # as SGLang's TP worker, before each payload
            data = MultiprocessingSerializer.deserialize(
                normalize_serialized_named_tensor_payload(entry))
            bucket = FlattenedTensorBucket(
                flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
            ranks.append({n: digest(t) for n, t in bucket.reconstruct_tensors()})
            del data, bucket
        except Exception as err:
            ranks.append({"error": f"{type(err).__name__}: {err}"})
    print(json.dumps(ranks), flush=True)
"""


class Decoder:
    """The decoding process (~15 s to import SGLang, so one per module)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT / ".venv" / "sglang")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DECODER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=str(ROOT),
        )  # fmt: skip
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the decoder exited ({self.proc.wait()})")
        return line.strip()

    def decode(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(body) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def decoder() -> Iterator[Decoder]:
    d = Decoder()
    yield d
    d.close()


def named_tensors(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and odd sizes: in this order a float32 lands at byte 60 before an int64."""
    g = torch.Generator().manual_seed(3)
    named = [
        ("model.layers.0.attn.q.weight", torch.randn(3, 5, generator=g)),  # 60 bytes
        ("model.layers.0.attn.positions", torch.arange(7, dtype=torch.int64) * 3 - 5),
        ("model.layers.0.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.up.weight", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.scale", torch.randn(5, generator=g).to(torch.float16)),
        ("model.norm.eps", torch.tensor(1e-6)),  # a 0-d tensor
        ("lm_head.weight", torch.randn(4, 3, generator=g)),
    ]
    return [(n, t.to(device)) for n, t in named]


class Engine:
    """Stands in for the engines' HTTP calls (sync.py's EngineCalls): each body is judged by
    SGLang's request class and decoded while the trainer holds the bucket, as a server
    answers before the trainer lets go."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.bodies: list[dict[str, Any]] = []
        self.decoded: list[list[dict[str, Any]]] = []

    async def each(self, urls: list[str], path: str, body: Any) -> dict[str, object]:
        assert path == "/update_weights_from_tensor"
        for i, url in enumerate(urls):
            sent = body(i, url)
            self.bodies.append(sent)
            self.decoded.append(self.decoder.decode(sent))
        return {}


def push(decoder: Decoder, named: list[tuple[str, torch.Tensor]]) -> Engine:
    import asyncio

    engine = Engine(decoder)
    buckets = plan_buckets(named, BUCKET_BYTES)
    failed = asyncio.run(sglang_format.push_sglang(engine, {URL: TP}, buckets, 7))
    assert failed == {}
    return engine


def check(engine: Engine, named: list[tuple[str, torch.Tensor]]) -> None:
    """Every body whole to SGLang, and every rank of every bucket the trainer's bytes."""
    want = {n: digest(t) for n, t in named}
    problems = [admin_problems("/update_weights_from_tensor", b) for b in engine.bodies]
    assert problems == [[]] * len(engine.bodies), problems
    got: dict[str, Any] = {}
    for k, ranks in enumerate(engine.decoded):
        assert len(ranks) == TP, f"bucket {k + 1}: {len(ranks)} payload(s) for {TP} TP ranks"
        for rank, tensors in enumerate(ranks):
            assert "error" not in tensors, f"bucket {k + 1}, rank {rank}: {tensors['error']}"
            wrong = {n: d for n, d in tensors.items() if d != want.get(n)}
            assert not wrong, f"bucket {k + 1}, rank {rank}: sha256 differs for {sorted(wrong)}"
            got |= tensors
    assert got == want


def test_sglang_reads_the_trainers_tensors_from_its_payload_bit_for_bit(decoder):
    named = named_tensors()
    engine = push(decoder, named)
    check(engine, named)
    assert [(b["load_format"], b["flush_cache"], b.get("weight_version")) for b in engine.bodies] == [
        ("flattened_bucket", False, None), ("flattened_bucket", True, "7"),
    ]  # fmt: skip
    # In the caller's order the int64 would sit at byte 60 (and the float32 scalar at 22 of
    # bucket 2): each bucket goes largest item size first instead.
    assert [list(ranks[0]) for ranks in engine.decoded] == [
        ["model.layers.0.attn.positions", "model.layers.0.attn.q.weight",
         "model.layers.0.norm.weight"],
        ["model.norm.eps", "lm_head.weight", "model.layers.0.mlp.up.weight",
         "model.layers.0.mlp.scale"],
    ]  # fmt: skip


def test_shifted_offsets_are_caught(decoder, monkeypatch):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    original = FlattenedTensorBucket.get_metadata

    def shifted(self: Any) -> list[Any]:  # the first tensor's bytes read 8 bytes late
        first, *rest = original(self)
        return [dataclasses.replace(first, start_idx=8, end_idx=first.end_idx + 8), *rest]

    monkeypatch.setattr(FlattenedTensorBucket, "get_metadata", shifted)
    named = named_tensors()
    engine = push(decoder, named)
    with pytest.raises(AssertionError, match="bucket 1, rank 0: sha256 differs") as caught:
        check(engine, named)
    print(f"shifted offsets: {caught.value}")


def serializations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SGLang's MultiprocessingSerializer.serialize, counted: one entry per call."""
    from sglang.srt.utils.common import MultiprocessingSerializer

    calls: list[int] = []
    real = MultiprocessingSerializer.serialize

    def counted(obj: Any, output_str: bool = False) -> Any:
        calls.append(1)
        return real(obj, output_str=output_str)

    monkeypatch.setattr(MultiprocessingSerializer, "serialize", staticmethod(counted))
    return calls


def test_each_rank_gets_a_serialization_of_its_own(decoder, monkeypatch):
    """One serialization per TP rank, as SGLang's own Engine makes them: over CUDA IPC torch
    counts a reference to the producer's memory per serialization and each receiving rank
    drops one, so a payload shared by two ranks frees the bucket under the second. (On the
    CPU, memory shared by name is opened as often as asked: both ranks would read it, so the
    count is what shows it here.) The broken variant, one payload handed to both, is caught."""
    calls = serializations(monkeypatch)
    named = named_tensors()
    check(push(decoder, named), named)
    buckets = len(plan_buckets(named, BUCKET_BYTES))
    assert len(calls) == TP * buckets

    serialize = sglang_format.serialize_bucket

    def one_for_all(bucket: Any, copies: int, to_host: bool) -> tuple[list[str], torch.Tensor]:
        payloads, flat = serialize(bucket, 1, to_host)
        return payloads * copies, flat

    monkeypatch.setattr(sglang_format, "serialize_bucket", one_for_all)
    calls.clear()
    check(push(decoder, named), named)  # each rank reads it
    assert len(calls) == buckets  # one for both: what the count catches


@pytest.mark.gpu
def test_sglang_reads_the_trainers_cuda_tensors_over_cuda_ipc(decoder):
    """On a GPU: CUDA IPC handles, the device as the GPU's UUID, and the trainer's memory
    back once every rank answered (`ipc_collect`)."""
    named = named_tensors("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = push(decoder, named)
    check(engine, named)
    uuid = str(torch.cuda.get_device_properties(0).uuid).encode()
    for body in engine.bodies:
        for entry in body["serialized_named_tensors"]:
            assert uuid in base64.b64decode(entry), "the device is not written as its UUID"
    deadline = time.monotonic() + 10
    while torch.cuda.memory_allocated() > before and time.monotonic() < deadline:
        torch.cuda.ipc_collect()
        time.sleep(0.1)
    assert torch.cuda.memory_allocated() == before


def test_a_session_left_open_is_closed_and_one_without_sessions_goes_without():
    """SGLang refuses a second /begin_weight_update while one is open, with the words
    open_sessions looks for (read from its scheduler's source); a server that has no such
    endpoint (404) is updated without a session, one that fails otherwise is out."""
    import asyncio
    import inspect

    from sglang.srt.managers.scheduler_components import weight_updater

    source = inspect.getsource(weight_updater.SchedulerWeightUpdaterManager.begin_weight_update)
    assert "a weight-update session is already open" in source

    class Servers:
        def __init__(self) -> None:
            self.open = {"left-open"}
            self.sent: list[tuple[str, str]] = []

        async def each(self, urls: list[str], path: str, body: Any) -> dict[str, object]:
            failed: dict[str, object] = {}
            for i, url in enumerate(urls):
                assert admin_problems(path, body(i, url)) == []
                self.sent.append((url, path))
                if url == "older":
                    failed[url] = f"{path}: HTTP 404: Not Found"
                elif url == "broken":
                    failed[url] = f"{path}: HTTP 400: scheduler gone"
                elif path == sglang_format.BEGIN_PATH and url in self.open:
                    failed[url] = f"{path}: HTTP 400: a weight-update session is already open"
                elif path == sglang_format.BEGIN_PATH:
                    self.open.add(url)
                else:
                    self.open.discard(url)
            return failed

    servers = Servers()
    urls = ["fresh", "left-open", "older", "broken"]
    opened, failed = asyncio.run(sglang_format.open_sessions(servers, urls))
    assert opened == ["fresh", "left-open"] and list(failed) == ["broken"]
    assert ("left-open", "/end_weight_update") in servers.sent
    assert servers.open == {"fresh", "left-open"}
