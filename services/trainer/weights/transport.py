"""Which way the weights go to each engine (`--update-weight-transport`), and the two ways that
need no process group.

    route = choose(setting, trainer, engine)      per engine, from where both sides live
    failed = await push_tensors(calls, routes, buckets, version)
    failed = await push_disk(calls, engines, buckets, version, directory)

The routes (`Route.transport`):

    group    a weight-update process group (process_group.py, group_route.py): one broadcast
             per bucket to every engine in it; NCCL when the trainer and every engine in the
             group are on GPUs, gloo when any of them is on a CPU (`group_backend`)
    tensor   `/update_weights_from_tensor` with a handle to the bucket's bytes: to millstream's
             engine a JSON handle (common/tensor_share.py), CUDA IPC when the engine is on the
             trainer's GPU (the one way there: NCCL refuses two ranks on one GPU), shared
             memory when it is on the same machine and either side is on a CPU; to a real
             SGLang server on the trainer's GPU, SGLang's own format over CUDA IPC
             (sglang_route.py: a pickled FlattenedTensorBucket per TP rank), which needs sglang
             importable in the trainer; forced (`tensor`) to an SGLang server the launcher
             started on this machine's CPU, the same format with the bytes in the request
    disk     safetensors files in a directory both sides see (--update-weight-disk-dir) and
             `/update_weights_from_disk`: slow, and works wherever a file system is shared

`auto` (the default) picks per engine: the trainer's GPU -> tensor (CUDA IPC: millstream's
handle, or SGLang's format for an SGLang server `millstream train` started there, which takes
no other handle: the launcher knows where it put it), or disk for such a server where sglang
is not importable in the trainer (the start-up line says why); the same machine with either
side on a CPU -> tensor (shared memory: bench_weight_sync.py measures it against gloo);
anything else, or an engine that does not say where it lives (a real SGLang server elsewhere)
-> group. An engine that lists no `weight_transports` (millstream's engine always does) is an
SGLang server. `nccl` (Miles' name for the group), `tensor` and `disk` force one, and a forced
one that cannot work for an engine is refused with the reason (`TransportError`) instead of a
hang. An engine whose tensor update fails to open millstream's handle (a container with a
private /dev/shm) is moved to the group for the rest of the run: a sync never dies on a
topology it can handle.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from millstream.common import tensor_share, threads
from millstream.common.errors import MillstreamError

from . import sglang_route
from .calls import Calls
from .process_group import FLATTENED_BUCKET, Bucket, flatten_bytes

AUTO, NCCL, TENSOR, DISK = "auto", "nccl", "tensor", "disk"
SETTINGS = (AUTO, NCCL, TENSOR, DISK)
GROUP = "group"
CUDA_IPC, SHM = "cuda_ipc", "shm"
SGLANG = "sglang"  # TENSOR to a real SGLang server: its own format over CUDA IPC
SGLANG_BYTES = "sglang_bytes"  # ... on this machine's CPU: its own format, the bytes in the request
SGLANG_HANDLES = (SGLANG, SGLANG_BYTES)


class TransportError(MillstreamError):
    """A forced --update-weight-transport that cannot reach an engine."""


@dataclass(frozen=True)
class Route:
    transport: str  # GROUP, TENSOR or DISK
    why: str
    handle: str | None = None  # TENSOR: CUDA_IPC, SHM or SGLANG

    def __str__(self) -> str:
        how = {
            CUDA_IPC: " over CUDA IPC",
            SHM: " over shared memory",
            SGLANG: " in SGLang's format over CUDA IPC",
            SGLANG_BYTES: " in SGLang's format, its bytes in the request",
        }.get(self.handle or "", "")
        return f"{self.transport}{how} ({self.why})"


def _on_cpu(place: Mapping[str, Any]) -> bool:
    return str(place.get("device", "cpu")).startswith("cpu")


def choose(
    setting: str,
    trainer: Mapping[str, Any],
    engine: Mapping[str, Any] | None,
    sglang_missing: Callable[[], str | None] = sglang_route.unavailable,
) -> Route:
    """The route to one engine. `trainer` and `engine` are placements
    (tensor_share.placement; an engine's from its /get_server_info, or the launcher's for an
    SGLang server; None when nobody says); `sglang_missing`: why SGLang's format cannot be
    made here (None: it can), asked only for an SGLang server on the trainer's GPU."""
    if setting not in SETTINGS:
        raise ValueError(f"--update-weight-transport {setting!r}: one of {SETTINGS}")
    if setting == DISK:
        return Route(DISK, "--update-weight-transport disk")
    takes_tensors = engine is not None and TENSOR in engine.get("weight_transports", ())
    same_gpu = engine is not None and tensor_share.same_gpu(trainer, engine)
    same_host = engine is not None and tensor_share.same_host(trainer, engine)
    sglang = engine is not None and "weight_transports" not in engine
    sglang_here = same_gpu and sglang
    # The launcher's SGLang server on this machine's CPU (tests; a CPU-only trial run)
    sglang_cpu_here = sglang and same_host and engine is not None and _on_cpu(engine)
    if setting == NCCL:
        if same_gpu:
            raise TransportError(
                "--update-weight-transport nccl: the engine is on the trainer's GPU, and NCCL "
                "cannot put two ranks on one GPU; use auto (CUDA IPC) or disk"
            )
        return Route(GROUP, "--update-weight-transport nccl")
    if setting == TENSOR:
        if sglang_here:
            missing = sglang_missing()
            if missing is not None:
                raise TransportError(
                    "--update-weight-transport tensor: the SGLang server on the trainer's GPU "
                    f"takes tensors in SGLang's format, and {missing}; use auto or disk"
                )
            forced = "--update-weight-transport tensor; an SGLang server on the trainer's GPU"
            return Route(TENSOR, forced, SGLANG)
        if sglang_cpu_here:
            missing = sglang_missing()
            if missing is not None:
                raise TransportError(
                    "--update-weight-transport tensor: the SGLang server on this machine's CPU "
                    f"takes tensors in SGLang's format, and {missing}; use auto or disk"
                )
            forced = "--update-weight-transport tensor; an SGLang server on this machine's CPU"
            return Route(TENSOR, forced, SGLANG_BYTES)
        if not (takes_tensors and same_host):
            raise TransportError(
                "--update-weight-transport tensor: the engine is not on this machine (or does "
                "not take shared tensors); handles work only on one machine: use auto, nccl "
                "or disk"
            )
        if same_gpu:
            return Route(TENSOR, "--update-weight-transport tensor; same GPU", CUDA_IPC)
        return Route(TENSOR, "--update-weight-transport tensor; same machine", SHM)
    if engine is None:
        return Route(GROUP, "the engine does not say where it lives")
    if same_gpu and takes_tensors:
        return Route(TENSOR, "on the trainer's GPU", CUDA_IPC)
    if sglang_here:  # the launcher put it there: no NCCL (two ranks on one GPU), no our handle
        missing = sglang_missing()
        if missing is None:
            return Route(TENSOR, "an SGLang server on the trainer's GPU", SGLANG)
        return Route(DISK, f"an SGLang server on the trainer's GPU; {missing}")
    if same_gpu:
        return Route(DISK, "on the trainer's GPU, taking no shared tensors (NCCL cannot)")
    if same_host and takes_tensors and (_on_cpu(trainer) or _on_cpu(engine)):
        return Route(TENSOR, "on this machine, on a CPU", SHM)
    if not same_host:
        return Route(GROUP, "on another machine")
    return Route(GROUP, "on this machine's CPU" if _on_cpu(engine) else "on another GPU")


def group_backend(trainer: Mapping[str, Any], engines: Sequence[Mapping[str, Any] | None]) -> str:
    """NCCL when the trainer and every engine of the group are on GPUs, else gloo (the
    trainer's tensors then go through its CPU). An engine that says nothing of where it lives
    (real SGLang) is taken to be where the trainer is, as before transports were chosen."""
    if _on_cpu(trainer):
        return "gloo"
    return "gloo" if any(e is not None and _on_cpu(e) for e in engines) else "nccl"


async def push_tensors(
    calls: Calls,
    routes: Mapping[str, Route],
    buckets: Sequence[Bucket],
    version: int,
    shm: tensor_share.ShmBuffer,
    flush: bool = True,
) -> dict[str, object]:
    """Every bucket to every engine of `routes` (all TENSOR) as one shared handle of its
    bytes (CUDA IPC, or `shm`'s file, which every bucket reuses: the engines copied the last
    one in before they answered); the version goes with the last. The failed engines, with
    why (an engine that failed a bucket gets no later one)."""
    failed: dict[str, object] = {}
    engines = list(routes)
    for k, bucket in enumerate(buckets):
        engines = [u for u in engines if u not in failed]
        if not engines:
            break
        kinds = {routes[u].handle for u in engines}
        try:
            shared = await threads.compute(_share_bucket, bucket, kinds, shm)
        except OSError as err:  # /dev/shm full or missing here: the group can serve them
            return failed | {
                u: f"opening the shared bucket failed on the trainer: {err}" for u in engines
            }
        try:
            dtypes = [t.dtype for t in bucket.tensors]
            shapes = [list(t.shape) for t in bucket.tensors]
            entries = {
                kind: tensor_share.bucket_request(handle, bucket.names, dtypes, shapes)
                for kind, (handle, _) in shared.items()
            }
            last = k == len(buckets) - 1

            def body(_i: int, url: str, entries=entries, last=last) -> dict[str, Any]:
                out: dict[str, Any] = {
                    "serialized_named_tensors": [entries[routes[url].handle]],
                    "load_format": FLATTENED_BUCKET,
                    "flush_cache": last and flush,
                }
                if last:
                    out["weight_version"] = str(version)
                return out

            failed |= await calls.each(engines, "/update_weights_from_tensor", body)
        finally:
            for _, release in shared.values():
                release()
    return failed


def _share_bucket(
    bucket: Bucket, kinds: set[str | None], shm: tensor_share.ShmBuffer
) -> dict[str, tuple[dict[str, Any], Callable[[], None]]]:
    """The bucket's bytes behind each kind of handle asked for, with what gives them back:
    a flattened copy on the trainer's GPU (CUDA IPC), or written into `shm`'s file."""
    out: dict[str, tuple[dict[str, Any], Callable[[], None]]] = {}
    if CUDA_IPC in kinds:
        flat = flatten_bytes([t.detach() for t in bucket.tensors])
        torch.cuda.current_stream(flat.device).synchronize()  # written before it is read
        shared = tensor_share.share(flat)
        out[CUDA_IPC] = (shared.handle, shared.release)
    if SHM in kinds:
        out[SHM] = (shm.write(bucket.tensors), lambda: None)
    return out


async def push_disk(
    calls: Calls,
    engines: list[str],
    buckets: Sequence[Bucket],
    version: int,
    directory: Path,
    flush: bool = True,
) -> dict[str, object]:
    """The weights as safetensors files in `directory`/v{version}/, one per bucket, then
    `/update_weights_from_disk` on every engine; older versions' files are removed."""
    target = directory / f"v{version}"
    await threads.compute(_write_buckets, buckets, target)
    failed = await calls.each(
        engines,
        "/update_weights_from_disk",
        lambda _i, _u: {
            "model_path": str(target),
            "weight_version": str(version),
            "flush_cache": flush,
        },
    )
    for old in directory.glob("v*"):
        if old != target and old.name[1:].isdigit() and int(old.name[1:]) < version:
            await asyncio.to_thread(shutil.rmtree, old, True)
    return dict(failed)


def _write_buckets(buckets: Sequence[Bucket], target: Path) -> None:
    from safetensors.torch import save_file

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for k, bucket in enumerate(buckets):
        tensors = {
            n: t.detach().to("cpu").contiguous()
            for n, t in zip(bucket.names, bucket.tensors, strict=True)
        }
        save_file(tensors, str(partial / f"weights-{k:05d}.safetensors"))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def opening_failed(why: object) -> bool:
    """An engine's tensor update failed at opening the handle: the memory is not shared with
    it (another machine after all, a container's private /dev/shm), so the group can serve."""
    return "opening the shared bucket" in str(why)


def trainer_placement(buckets: Sequence[Bucket]) -> dict[str, Any]:
    device = buckets[0].tensors[0].device if buckets and buckets[0].tensors else torch.device("cpu")
    return tensor_share.placement(device)
