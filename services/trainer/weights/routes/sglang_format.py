"""The tensor route to a real SGLang server on the trainer's GPU, in SGLang's own format
(`SglangSender`, for the handles SGLANG and SGLANG_BYTES), and the weight-update session SGLang
wants around tensor and group (nccl) updates. To a server on this
machine's CPU (forced `tensor`: tests, a CPU trial run) the same format carries the bucket's
bytes instead of a CUDA IPC handle (`_by_value` says why no shared memory).

For each bucket (at most --update-weight-buffer-size bytes, `aligned`: SGLang views each piece
of the flat bytes as its dtype):

    flat = FlattenedTensorBucket(named_tensors=bucket)                 SGLang's class: one
    payload = MultiprocessingSerializer.serialize(                     allocation, so one CUDA
        {"flattened_tensor": flat.get_flattened_tensor(),              IPC handle per bucket
         "metadata": flat.get_metadata()}, output_str=True)            (base64 of a pickle)
    POST /update_weights_from_tensor {"serialized_named_tensors": [payload per TP rank],
        "load_format": "flattened_bucket", "flush_cache": last, "weight_version": V (last)}
    (every engine answered) drop the bucket, torch.cuda.ipc_collect()

`sync_body` builds that body (SGLang's UpdateWeightsFromTensorReqInput). Each TP rank of the
server reads only its own entry (`serialized_named_tensors[tp_rank]`), and each entry is a
serialization of its own: torch counts one reference to the producer's memory per
serialization and each receiver drops one, so the counts balance (SGLang's own Engine does the
same, `_serialize_tensors_per_rank`). A TP server on the trainer's GPU and others opens the
bucket on the trainer's GPU from each rank, as Miles' colocated sender hands each engine rank
the bytes of the trainer rank on its GPU; here rank 0 sends for all. The producer keeps the
bucket until every engine answered (they copy before answering), then `ipc_collect` frees
what the receivers released.

A CUDA tensor's device goes in the pickle as the GPU's UUID, not this process's index: the
trainer and the server number GPUs differently when their CUDA_VISIBLE_DEVICES differ, and
SGLang's receiver (patch_torch `_rebuild_cuda_tensor_modified`) looks an UUID up among its own
GPUs. SGLang's sender-side patch (`monkey_patch_torch_reductions`) would do it by replacing
torch's tensor reducer for the whole process, and it breaks CPU tensors there (IndexError);
`_device_as_uuid` swaps the reducer in only while SGLang's serializer makes its pickler (which
copies the registry then), and passes every tensor that is not on a GPU through unchanged.

millstream never unpickles anything: it only produces this format. sglang is imported lazily,
here only (`unavailable` says why it cannot be: the route then falls back to disk, and the
start-up line says so); importing it applies SGLang's transformers compatibility patches in
the trainer, as in Miles, whose trainer imports SGLang too.

The session: SGLang takes /update_weights_from_tensor and /update_weights_from_distributed only
between POST /begin_weight_update (which restores weights it packed in place) and POST
/end_weight_update (which post-processes what was loaded: FP8 layouts for its kernels), and
refuses a second begin while one is open ("already open"). `open_sessions` closes such a
leftover (a trainer that died mid-sync) and opens again; a server without the endpoint (404:
an SGLang from before sessions) is updated without one.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from millstream.common import threads
from millstream.common.weight_routes import TENSOR

from ..calls import Calls
from .base import FLATTENED_BUCKET, SGLANG_BYTES, SGLANG_HANDLES, Bucket, Push, Sender

UPDATE_PATH = "/update_weights_from_tensor"
BEGIN_PATH, END_PATH = "/begin_weight_update", "/end_weight_update"
_STORAGE_DEVICE = 6  # in torch's rebuild_cuda_tensor arguments
_PICKLER = threading.Lock()


class SglangSender(Sender):
    """The tensor route to SGLang servers, in SGLang's format: over CUDA IPC (on the trainer's
    GPU), then with the bytes in the request (on this machine's CPU)."""

    name = TENSOR
    handles = SGLANG_HANDLES
    sessions = True

    async def send(self, push: Push, engines: list[str], buckets: Sequence[Bucket]) -> list[str]:
        if not engines:
            return []
        report, known = push.report, push.engines
        start = time.monotonic()
        failed: dict[str, object] = {}
        for handle in SGLANG_HANDLES:  # CUDA IPC, then the bytes (servers on the CPU)
            mine = [u for u in engines if known.routes[u].handle == handle]
            if mine:
                tp_sizes = {u: known.tp.get(u, 1) for u in mine}
                failed |= await push_sglang(
                    push.calls, tp_sizes, buckets, report.version, report.flush_cache,
                    to_host=handle == SGLANG_BYTES,
                )  # fmt: skip
        report.add_time("tensor", time.monotonic() - start)
        return await push.remove(engines, failed)


@functools.cache
def unavailable() -> str | None:
    """Why SGLang's format cannot be produced here (None: it can): sglang not importable."""
    try:
        import sglang.srt.utils.common
        import sglang.srt.weight_sync.tensor_bucket  # noqa: F401
    except Exception as err:  # any import failure: a broken install is as absent
        return f"sglang not importable here: {type(err).__name__}: {err}"
    return None


def sync_body(
    payloads: Sequence[str], last: bool, version: int, flush: bool = True
) -> dict[str, Any]:
    """The /update_weights_from_tensor body (SGLang's UpdateWeightsFromTensorReqInput);
    `flush`: the last bucket's flush_cache (SyncReport.flush_cache)."""
    body: dict[str, Any] = {
        "serialized_named_tensors": list(payloads),
        "load_format": FLATTENED_BUCKET,
        "flush_cache": last and flush,
    }
    if last:
        body["weight_version"] = str(version)
    return body


def begin_body() -> dict[str, Any]:
    """The /begin_weight_update body (BeginWeightUpdateReqInput): every runner."""
    return {"selector": "all"}


def end_body() -> dict[str, Any]:
    """The /end_weight_update body (EndWeightUpdateReqInput has no fields)."""
    return {}


def serialize_bucket(
    bucket: Bucket, copies: int, to_host: bool = False
) -> tuple[list[str], torch.Tensor]:
    """`copies` serializations of the bucket in SGLang's format, and the flattened tensor they
    share (keep it until every receiver answered); `to_host`: from host memory, its bytes in
    the payload (an SGLang server on the CPU), wherever the trainer's tensors are. Blocking:
    call it from a worker thread."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [
        (n, t.detach().cpu() if to_host else t.detach())
        for n, t in zip(bucket.names, bucket.tensors, strict=True)
    ]
    flat = FlattenedTensorBucket(named_tensors=named)
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    tensor = data["flattened_tensor"]
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()  # written before it is read
    scope = _device_as_uuid() if tensor.is_cuda else _by_value()
    with scope:
        payloads = [
            MultiprocessingSerializer.serialize(data, output_str=True) for _ in range(copies)
        ]
    return payloads, tensor


async def push_sglang(
    calls: Calls,
    tp_sizes: Mapping[str, int],
    buckets: Sequence[Bucket],
    version: int,
    flush: bool = True,
    to_host: bool = False,
) -> dict[str, object]:
    """Every bucket to every engine of `tp_sizes` (engine url -> its TP size) as SGLang's
    payloads (`to_host`: from host memory, for servers on the CPU); the version goes with the
    last. The failed engines, with why (an engine that failed a bucket gets no later one)."""
    failed: dict[str, object] = {}
    engines = list(tp_sizes)
    for k in range(len(buckets)):
        engines = [u for u in engines if u not in failed]
        if not engines:
            break
        bucket = await threads.compute(buckets.__getitem__, k)  # FP8 buckets cast on reading
        # One serialization per TP rank of each engine (module docstring: reference counts).
        total = sum(tp_sizes[u] for u in engines)
        payloads, flat = await threads.compute(serialize_bucket, bucket, total, to_host)
        starts = dict(zip(engines, _offsets([tp_sizes[u] for u in engines]), strict=True))
        last = k == len(buckets) - 1

        def body(_i: int, url: str, payloads=payloads, starts=starts, last=last) -> dict[str, Any]:
            mine = payloads[starts[url] : starts[url] + tp_sizes[url]]
            return sync_body(mine, last, version, flush)

        try:
            failed |= await calls.each(engines, UPDATE_PATH, body)
        finally:
            on_gpu = flat.is_cuda
            del payloads, flat
            if on_gpu:
                torch.cuda.ipc_collect()  # what the engines released, freed now
    return failed


async def open_sessions(calls: Calls, urls: list[str]) -> tuple[list[str], dict[str, object]]:
    """POST /begin_weight_update to every engine of `urls`: (those with a session open now,
    those that failed, with why). One with a session left open (a sync that died midway) gets
    it closed and opened again; one without the endpoint (HTTP 404: an SGLang from before
    sessions) is in neither list: its updates need none."""
    failed = dict(await calls.each(urls, BEGIN_PATH, lambda _i, _u: begin_body()))
    stale = [u for u, why in failed.items() if "already open" in str(why)]
    if stale:
        closing = await calls.each(stale, END_PATH, lambda _i, _u: end_body())
        again = await calls.each(
            [u for u in stale if u not in closing], BEGIN_PATH, lambda _i, _u: begin_body()
        )
        failed = {u: w for u, w in failed.items() if u not in stale} | dict(closing) | again
    older = {u for u, why in failed.items() if f"{BEGIN_PATH}: HTTP 404" in str(why)}
    opened = [u for u in urls if u not in failed]
    return opened, {u: w for u, w in failed.items() if u not in older}


async def close_sessions(calls: Calls, urls: list[str]) -> dict[str, object]:
    """POST /end_weight_update to every engine of `urls`; the failed, with why."""
    return dict(await calls.each(urls, END_PATH, lambda _i, _u: end_body()))


def _offsets(sizes: Sequence[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


@contextlib.contextmanager
def _device_as_uuid() -> Iterator[None]:
    """torch's tensor reducer, writing a CUDA tensor's GPU as its UUID, for picklers made
    meanwhile (module docstring)."""
    from multiprocessing.reduction import ForkingPickler

    registry: dict[type, Callable[..., Any]] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    with _PICKLER:
        before = registry.get(torch.Tensor)
        registry[torch.Tensor] = _reduce_by_uuid
        try:
            yield
        finally:
            if before is None:
                registry.pop(torch.Tensor, None)
            else:
                registry[torch.Tensor] = before


@contextlib.contextmanager
def _by_value() -> Iterator[None]:
    """Picklers made meanwhile write a CPU tensor's bytes into the payload (pickle's own
    reduction) instead of a handle to shared memory (torch's, which multiprocessing's
    ForkingPickler carries). Neither of torch's handles suits a server that is no child of
    this process: a file descriptor (torch's default on Linux) is fetched back from this
    process over a socket that checks multiprocessing's authkey, which an SGLang server never
    has (its scheduler fails the update with `AuthenticationError: digest sent was rejected`
    and the whole server exits); a named shared-memory file (the `file_system` strategy) has
    this process start torch_shm_manager, a daemon that outlives it while the server holds the
    memory, with this process's stdout and stderr (seen with SGLang 0.5.23 on the CPU:
    tests/sglang_live/test_routes.py). Bytes in the request cost a copy, on a CPU."""
    from multiprocessing.reduction import ForkingPickler

    registry: dict[type, Callable[..., Any]] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    with _PICKLER:
        saved = dict(registry)
        for kind, reduce in saved.items():
            if getattr(reduce, "__module__", "") == "torch.multiprocessing.reductions":
                del registry[kind]
        try:
            yield
        finally:
            registry.clear()
            registry.update(saved)


def _reduce_by_uuid(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda and isinstance(args[_STORAGE_DEVICE], int):
        uuid = str(torch.cuda.get_device_properties(args[_STORAGE_DEVICE]).uuid)
        args = (*args[:_STORAGE_DEVICE], uuid, *args[_STORAGE_DEVICE + 1 :])
    return rebuild, args
