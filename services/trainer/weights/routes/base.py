"""What every weight route has in common: what it sends (buckets of named tensors), how the
choice names it (`Route`), what it needs from the sync (`Push`, `Engines`) and what it does
(`Sender`: the trainer's side of one route; the engine's side is its admin endpoints).

What is sent: named tensors in buckets of at most --update-weight-buffer-size bytes, in the
caller's order (a tensor bigger than that goes alone; within a bucket, reordered only where a
tensor would sit at a byte offset its item size does not divide: `aligned`, which SGLang
needs); a bucket's `spec` is the body of /update_weights_from_distributed (names, dtypes as
"float32"/"bfloat16", shapes). A bucket crosses as one flat run of its tensors' bytes
(`flatten_bytes`, SGLang's load_format "flattened_bucket") wherever a route can: one
broadcast, one handle or one payload per bucket, not one per tensor (bench_weight_sync.py).

A sender gets, per sync, the engines the choice gave its route and the buckets they take (an
FP8 SGLang server's quantized: fp8_weights.py), and answers with the engines that hold them
now; one that failed is removed from routing through `Push.remove` (sync.py `_remove`), named
in the report with why, and the rest go on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from millstream.common.errors import MillstreamError

from ..calls import EngineCalls, SyncReport

if TYPE_CHECKING:
    from ..router_admin import RouterAdmin

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for one bucket as one piece
# How a tensor route hands a bucket over (`Route.handle`): millstream's handle (tensor.py), or
# SGLang's own format (sglang_format.py) over CUDA IPC, or with the bytes in the request.
CUDA_IPC, SHM, SGLANG, SGLANG_BYTES = "cuda_ipc", "shm", "sglang", "sglang_bytes"
SGLANG_HANDLES = (SGLANG, SGLANG_BYTES)

NamedTensors = Iterable[tuple[str, torch.Tensor]]

# sync.py's WeightSync._remove: take engines out of routing, named in the report with why.
Remove = Callable[
    ["RouterAdmin", list[str], Mapping[str, object], SyncReport], Awaitable[list[str]]
]


class TransportError(MillstreamError):
    """A forced --update-weight-transport that cannot reach an engine."""


@dataclass(frozen=True)
class Route:
    """One engine's route (choose.py): its name (common/weight_routes.py: nccl, tensor or
    disk), why it was chosen, and for tensor the handle (CUDA_IPC, SHM, SGLANG, SGLANG_BYTES)."""

    name: str
    why: str
    handle: str | None = None

    def __str__(self) -> str:
        how = {
            CUDA_IPC: " over CUDA IPC",
            SHM: " over shared memory",
            SGLANG: " in SGLang's format over CUDA IPC",
            SGLANG_BYTES: " in SGLang's format, its bytes in the request",
        }.get(self.handle or "", "")
        return f"{self.name}{how} ({self.why})"


@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    def spec(self) -> dict[str, Any]:
        return {
            "names": self.names,
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
        }


def plan_buckets(named: NamedTensors, max_bytes: int) -> list[Bucket]:
    """Consecutive buckets of at most `max_bytes` each (a bigger tensor goes alone), each
    `aligned`."""
    if max_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0 (got {max_bytes})")
    buckets: list[Bucket] = []
    seen: set[str] = set()
    for name, tensor in named:
        if name in seen:
            raise ValueError(f"named tensors: {name!r} appears twice")
        seen.add(name)
        size = tensor.numel() * tensor.element_size()
        if not buckets or (buckets[-1].names and buckets[-1].nbytes + size > max_bytes):
            buckets.append(Bucket())
        bucket = buckets[-1]
        bucket.names.append(name)
        bucket.tensors.append(tensor)
        bucket.nbytes += size
    return [aligned(b) for b in buckets]


def aligned(bucket: Bucket) -> Bucket:
    """The bucket with every tensor at a byte offset its item size divides, in its flattened
    bytes: SGLang views each piece of a flattened bucket as its dtype and refuses (or fails on)
    one that is not (`FlattenedTensorBucket.empty`: "Unaligned received tensor";
    `reconstruct_tensors`: "storage_offset() must be divisible"). The caller's order is kept
    when it already is; else the tensors go largest item size first (stable), which aligns
    them all, since item sizes are powers of two."""
    offset, fits = 0, True
    for t in bucket.tensors:
        fits = fits and offset % t.element_size() == 0
        offset += t.numel() * t.element_size()
    if fits:
        return bucket
    order = sorted(range(len(bucket.names)), key=lambda i: -bucket.tensors[i].element_size())
    return Bucket(
        [bucket.names[i] for i in order], [bucket.tensors[i] for i in order], bucket.nbytes
    )


def on_cpu(place: Mapping[str, Any]) -> bool:
    """A placement (tensor_share.placement) on a CPU."""
    return str(place.get("device", "cpu")).startswith("cpu")


def flatten_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """SGLang's flattened_bucket layout: each tensor's bytes, in order, as one uint8 tensor."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


class Engines(Protocol):
    """What the routes know of the engines, kept between syncs (engines.py EngineBook)."""

    placements: dict[str, dict[str, Any] | None]  # where each lives (None: it does not say)
    ranks: dict[str, int]  # its ranks in an update group
    tp: dict[str, int]  # an SGLang server's TP size: the entries of a tensor update
    routes: dict[str, Route]
    moved_to_group: set[str]  # could not open millstream's handle: nccl's from now on


@dataclass
class Push:
    """One sync's push as a route sees it: the engines' admin calls, the router, the report,
    where the trainer's weights live, what is known of the engines, and how to remove one."""

    calls: EngineCalls
    router: RouterAdmin
    report: SyncReport
    trainer: dict[str, Any]  # tensor_share.placement of the weights' device
    engines: Engines
    _remove: Remove

    async def remove(self, engines: list[str], failed: Mapping[str, object]) -> list[str]:
        """`failed` out of routing, named in the report with why; the rest of `engines`."""
        return await self._remove(self.router, engines, failed, self.report)


class Sender(ABC):
    """The trainer's side of one route (module docstring)."""

    name: ClassVar[str]  # the route's (common/weight_routes.py)
    handles: ClassVar[tuple[str | None, ...]] = (None,)  # the Route.handle values it serves
    # SGLang servers on it take updates only inside a weight-update session (sglang_format.py)
    sessions: ClassVar[bool] = False

    def serves(self, route: Route) -> bool:
        return route.name == self.name and route.handle in self.handles

    @abstractmethod
    async def send(self, push: Push, engines: list[str], buckets: Sequence[Bucket]) -> list[str]:
        """Every bucket to every engine of `engines`, the version with the last; the engines
        that hold them now."""

    def close(self) -> None:  # noqa: B027 (most keep nothing)
        """Give back what the sender keeps between syncs."""
