"""The tensor route with millstream's handle (to millstream's engine): `/update_weights_from_
tensor` with one JSON handle per bucket (common/tensor_share.py), the version with the last.

    CUDA_IPC   the engine is on the trainer's GPU: a flattened copy of the bucket on that GPU,
               shared by its CUDA IPC handle (the one way there: NCCL refuses two ranks on one
               GPU), given back once every engine answered
    SHM        the engine is on this machine and either side is on a CPU: the bucket written
               into one file in /dev/shm that every bucket reuses (the engines copied the last
               one in before they answered) and both sides keep mapped

An engine whose tensor update fails to open the handle (a container with a private /dev/shm,
a GPU it does not see) is moved to the nccl route for the rest of the run (`moved_to_group`,
served by the group in this sync already: delivery.py): a sync never dies on a topology it
can handle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from millstream.common import tensor_share, threads
from millstream.common.weight_routes import TENSOR

from ..calls import Calls
from .base import CUDA_IPC, FLATTENED_BUCKET, SHM, Bucket, Push, Route, Sender, flatten_bytes

log = logging.getLogger("millstream.trainer")
OPENING_FAILED = "opening the shared bucket"  # in the engine's answer (engine: _open_shared)


class TensorSender(Sender):
    """The tensor route's CUDA IPC and shared-memory handles (module docstring); keeps the
    shared-memory file from sync to sync."""

    name = TENSOR
    handles = (CUDA_IPC, SHM)

    def __init__(self, shm_dir: str):
        self._shm = tensor_share.ShmBuffer(shm_dir)

    async def send(self, push: Push, engines: list[str], buckets: Sequence[Bucket]) -> list[str]:
        if not engines:
            return []
        report, known = push.report, push.engines
        start = time.monotonic()
        routes = {u: known.routes[u] for u in engines}
        failed = await push_tensors(
            push.calls, routes, buckets, report.version, self._shm, report.flush_cache
        )
        report.add_time("tensor", time.monotonic() - start)
        for url, why in failed.items():
            if opening_failed(why):
                log.warning(
                    "weight sync v%d: %s could not open the shared bucket (%s); the update "
                    "group serves it from now on", report.version, url, why,
                )  # fmt: skip
                known.moved_to_group.add(url)
        moved = known.moved_to_group
        removed = {u: why for u, why in failed.items() if u not in moved}
        return await push.remove([u for u in engines if u not in moved], removed)

    def close(self) -> None:
        self._shm.close()


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
            return failed | {u: f"{OPENING_FAILED} failed on the trainer: {err}" for u in engines}
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


def opening_failed(why: object) -> bool:
    """An engine's tensor update failed at opening the handle: the memory is not shared with
    it (another machine after all, a container's private /dev/shm), so the group can serve."""
    return OPENING_FAILED in str(why)
