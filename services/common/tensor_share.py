"""Tensors handed from one process to another on the same machine, without copying them through a
socket: the tensor transport of a weight sync (SGLang's `/update_weights_from_tensor` with
`load_format: "flattened_bucket"`, where a bucket is ONE flattened tensor, so one handle).

    placement()                           where this process computes: host, device, GPU
    shared = share(flat_uint8)            trainer, on a GPU: a CUDA IPC handle to a bucket ...
    handle = buffer.write(tensors)        ... on a CPU: the bucket flattened into a shm file
    body = bucket_request(handle, names, dtypes, shapes)      ... for /update_weights_from_tensor
    shared.release()                      ... its memory back once every engine took it
    named = open_bucket(entry, mappings)  engine: the named tensors, views of the shared bytes

Two kinds of handle, each a JSON object (no pickle: docs/architecture.md):

- `cuda_ipc`: the CUDA IPC handle of the allocation holding the bytes, with the fields torch's
  multiprocessing reductions put in their pickle (`UntypedStorage._share_cuda_()`: device,
  handle, sizes, the producer's ref counter and event), the bytes base64-encoded, and the
  producer GPU's UUID (as torch writes it; nvidia-smi adds a `GPU-` prefix):

      {"kind": "cuda_ipc", "gpu_uuid": "8f0c1d2e-...", "device": 0, "handle": b64,
       "storage_size_bytes": n, "storage_offset_bytes": n, "ref_counter_handle": b64,
       "ref_counter_offset": n, "event_handle": b64, "event_sync_required": bool,
       "tensor_offset": n, "numel": n}

  The receiver opens the same GPU memory (`UntypedStorage._new_shared_cuda`): no copy, and it
  only works on the same GPU of the same machine. Which of its GPUs that is, it finds by the
  UUID (`local_device`), as SGLang and Miles do: two processes number GPUs differently
  (CUDA_VISIBLE_DEVICES=1 makes the producer's cuda:1 the receiver's cuda:0), so `device`, the
  producer's index, is only the fallback for a handle without a UUID. A receiver that sees no
  GPU with that UUID refuses the handle (ValueError) and gives back the reference torch counted
  for it: the producer's memory is freed only once every reference is dropped (`_share_cuda_`
  counts one; a receiver drops it when its last view goes), so a refusal that kept it would hold
  the bucket for good. SGLang carries the same fields pickled (`MultiprocessingSerializer`);
  after its copy the receiver calls `torch.cuda.ipc_collect()`, and the producer keeps its
  tensor alive until every receiver answered.
- `shm`: a file in a shared-memory directory (/dev/shm) that both sides map
  (`UntypedStorage.from_file(shared=True)`): the CPU twin. The producer keeps one such file
  (`ShmBuffer`) and flattens each bucket straight into it; a receiver keeps its mapping
  (`Mappings`) and copies the bucket into its parameters before it answers, so the next bucket
  may go into the same bytes. One copy on each side, no socket, and no page faults after the
  first sync (a new file per bucket cost more than gloo's loopback: bench_weight_sync.py). The
  producer removes the file when it closes.

Each entry of `serialized_named_tensors` is the JSON text of `{"flattened_tensor": handle,
"metadata": [{name, shape, dtype, start_idx, end_idx, numel}, ...]}`: SGLang's
FlattenedTensorBucket fields, offsets in elements of a uint8 tensor (bytes).

`placement()` tells the two sides whether a handle can work: the same `host` (the machine's
boot id and its /dev/shm mount: containers with a private /dev/shm differ) and, for cuda_ipc,
the same GPU (`gpu_uuid`). Either side may still refuse a handle; the sync then falls back.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FLATTENED_BUCKET = "flattened_bucket"
SHM_DIR = "/dev/shm"
SHM_PREFIX = "millstream-weights-"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@functools.cache
def host_id(shm_dir: str = SHM_DIR) -> str:
    """Same value in two processes = one machine that shares `shm_dir` between them (read
    once per process: every weight sync asks)."""
    boot = _BOOT_ID.read_text().strip() if _BOOT_ID.is_file() else socket.gethostname()
    try:
        st = os.stat(shm_dir)
        return f"{boot}:{st.st_dev}:{st.st_ino}"
    except OSError:
        return f"{boot}:no-shm"


def placement(device: torch.device | str) -> dict[str, Any]:
    """Where a process with tensors on `device` computes: what each side of a weight sync
    tells the other (the engine in /get_server_info, the trainer from its weights)."""
    device = torch.device(device)
    out: dict[str, Any] = {"host": host_id(), "device": str(device), "gpu_uuid": None}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        out["device"] = f"cuda:{index}"
        out["gpu_uuid"] = str(torch.cuda.get_device_properties(index).uuid)
    return out


def same_gpu(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a.get("host") == b.get("host")
        and a.get("gpu_uuid") is not None
        and (a.get("gpu_uuid") == b.get("gpu_uuid"))
    )


def same_host(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("host") is not None and a.get("host") == b.get("host")


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


@dataclass
class Shared:
    """One flattened bucket handed out: its JSON handle, and what keeps the memory valid."""

    handle: dict[str, Any]
    tensor: torch.Tensor | None = None  # cuda_ipc: the producer's allocation, kept alive

    def release(self) -> None:
        """Every receiver took its copy: give the memory back. Idempotent."""
        if self.tensor is not None:
            self.tensor = None
            torch.cuda.ipc_collect()


def share(flat: torch.Tensor) -> Shared:
    """A CUDA IPC handle to `flat` (a 1-D uint8 tensor on a GPU), valid until released."""
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_cuda:
        raise ValueError(f"share: a 1-D uint8 CUDA tensor, got {flat.dtype} on {flat.device}")
    flat = flat.contiguous()
    storage = flat.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event, event_sync) = (
        storage._share_cuda_()
    )
    return Shared(
        {
            "kind": "cuda_ipc",
            "gpu_uuid": str(torch.cuda.get_device_properties(device).uuid),
            "device": int(device),
            "handle": _b64(handle),
            "storage_size_bytes": int(size),
            "storage_offset_bytes": int(offset),
            "ref_counter_handle": _b64(ref_handle),
            "ref_counter_offset": int(ref_offset),
            "event_handle": _b64(event),
            "event_sync_required": bool(event_sync),
            "tensor_offset": int(flat.storage_offset()),
            "numel": int(flat.numel()),
        },
        tensor=flat,
    )


class ShmBuffer:
    """A shared-memory file this process flattens buckets into, one after another: mapped
    once, grown (a new file) when a bucket is bigger, removed by `close`."""

    def __init__(self, shm_dir: str = SHM_DIR):
        self.shm_dir = shm_dir
        self.path: Path | None = None
        self._flat: torch.Tensor | None = None

    def write(self, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """The tensors' bytes back to back, from the start of the file (SGLang's
        flattened_bucket layout); the handle to them. OSError: no room in `shm_dir`."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        nbytes = sum(sizes)
        if self._flat is None or self._flat.numel() < nbytes:
            self.close()
            path = Path(self.shm_dir) / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
            with open(path, "wb") as f:
                f.truncate(nbytes)
            try:
                self._flat = _map(str(path), nbytes)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            self.path = path
        start = 0
        for t, size in zip(tensors, sizes, strict=True):
            src = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
            self._flat[start : start + size].copy_(src)
            start += size
        return {"kind": "shm", "path": str(self.path), "numel": nbytes}

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        self.path, self._flat = None, None


def _map(path: str, nbytes: int) -> torch.Tensor:
    flat = torch.empty(0, dtype=torch.uint8)
    if nbytes:
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        flat.set_(storage, 0, (nbytes,), (1,))
    return flat


class Mappings:
    """A receiver's shm mappings by path, the latest `keep` of them: a producer writes every
    bucket into the same file, so after the first the bytes are mapped and resident."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._by_path: dict[str, torch.Tensor] = {}

    def get(self, path: str) -> torch.Tensor:
        flat = self._by_path.pop(path, None)
        if flat is None:
            size = os.stat(path).st_size
            flat = _map(path, size)
        self._by_path[path] = flat  # the latest last
        while len(self._by_path) > self.keep:
            del self._by_path[next(iter(self._by_path))]
        return flat


def bucket_request(
    handle: dict[str, Any], names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> str:
    """One `serialized_named_tensors` entry: the handle and where each tensor's bytes are."""
    metadata, start = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        numel = torch.Size(shape).numel()
        end = start + numel * dtype.itemsize
        metadata.append(
            {"name": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
             "start_idx": start, "end_idx": end, "numel": numel}
        )  # fmt: skip
        start = end
    if start != handle["numel"]:
        raise ValueError(
            f"bucket_request: the tensors hold {start} bytes, the handle {handle['numel']}"
        )
    return json.dumps({"flattened_tensor": handle, "metadata": metadata})


def open_flat(handle: dict[str, Any], mappings: Mappings | None = None) -> torch.Tensor:
    """The producer's bytes as a 1-D uint8 tensor, opened from a handle (`share`,
    `ShmBuffer.write`); shm files through `mappings` when given (kept mapped)."""
    kind, numel = handle.get("kind"), int(handle["numel"])
    if kind == "shm":
        path = os.path.realpath(str(handle["path"]))
        if not Path(path).name.startswith(SHM_PREFIX) or Path(path).parent != Path(SHM_DIR):
            raise ValueError(f"shm path {path!r}: not a millstream weight bucket in {SHM_DIR}")
        flat = (mappings or Mappings(keep=0)).get(path)
        if flat.numel() < numel:
            raise ValueError(f"shm file {path}: {flat.numel()} bytes, the bucket needs {numel}")
        return flat[:numel]
    if kind == "cuda_ipc":
        try:
            index = local_device(handle, local_gpu_uuids())
        except ValueError:
            _give_back(handle)
            raise
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            index, _unb64(handle["handle"]), handle["storage_size_bytes"],
            handle["storage_offset_bytes"], _unb64(handle["ref_counter_handle"]),
            handle["ref_counter_offset"], _unb64(handle["event_handle"]),
            handle["event_sync_required"],
        )  # fmt: skip
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
        flat.set_(storage, handle["tensor_offset"], (numel,), (1,))
        return flat
    raise ValueError(f"flattened_tensor: unknown handle kind {kind!r} (shm or cuda_ipc)")


def _bare_uuid(text: str) -> str:
    """A GPU UUID as torch writes it (bare hex groups, lower case): nvidia-smi and
    CUDA_VISIBLE_DEVICES write `GPU-...` (`MIG-...` for a MIG instance)."""
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def local_device(handle: dict[str, Any], local_uuids: Sequence[str]) -> int:
    """The index, in this process's numbering, of the GPU a `cuda_ipc` handle's bytes live on:
    the one whose UUID (`local_uuids[i]` is cuda:i's) is the handle's `gpu_uuid`; ValueError
    naming it when this process sees none. A handle without a UUID gives the producer's index,
    right only where both processes number the GPUs alike."""
    wanted = handle.get("gpu_uuid")
    if wanted is None:
        return int(handle["device"])
    bare = [_bare_uuid(u) for u in local_uuids]
    if _bare_uuid(str(wanted)) in bare:
        return bare.index(_bare_uuid(str(wanted)))
    seen = ", ".join(f"cuda:{i} {u}" for i, u in enumerate(local_uuids)) or "none"
    raise ValueError(
        f"cuda_ipc handle: this process sees no GPU with UUID {wanted} (its GPUs: {seen}); "
        "the bytes are on another GPU than any it can open"
    )


def local_gpu_uuids() -> list[str]:
    """The UUID of each GPU this process sees, by torch's index (none without CUDA)."""
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def _give_back(handle: dict[str, Any]) -> None:
    """Drop the reference torch counted for this receiver of a `cuda_ipc` handle without
    opening it (torch.multiprocessing does the same for a storage it already has open); the
    producer then frees the bytes at its release. A counter file that is gone (the producer
    exited) is ignored by torch itself."""
    counter = handle.get("ref_counter_handle")
    if counter is None or not torch.backends.cuda.is_built():  # a CPU build cannot open it
        return
    torch.UntypedStorage._release_ipc_counter_cuda(
        _unb64(counter), int(handle["ref_counter_offset"])
    )


def open_bucket(entry: str, mappings: Mappings | None = None) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of one `serialized_named_tensors` entry: views of the shared bytes
    (valid until the producer writes its next bucket: copy them in before answering)."""
    body = json.loads(entry)
    flat = open_flat(body["flattened_tensor"], mappings)
    out = []
    for meta in body["metadata"]:
        dtype = getattr(torch, str(meta["dtype"]).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"metadata: {meta['dtype']!r} is not a torch dtype")
        start, end = int(meta["start_idx"]), int(meta["end_idx"])
        if not 0 <= start <= end <= flat.numel():
            raise ValueError(
                f"metadata: {meta['name']} [{start}, {end}) outside {flat.numel()} bytes"
            )
        piece = flat[start:end]
        if start % dtype.itemsize:  # a view at such an offset is refused: copy its bytes
            piece = piece.clone()
        out.append((meta["name"], piece.view(dtype).reshape(meta["shape"])))
    return out
