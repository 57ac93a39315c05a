"""Which route the weights take to each engine (`choose`), and the senders of every route
(`senders`, the one factory).

    route = choose(setting, trainer, engine)      per engine, from where both sides live

`setting` is --update-weight-transport as the config holds it (common/weight_routes.py: the
flag is parsed and checked there, once; aliases are already the route's one name). The routes
(`Route.name`, and the module that sends by it):

    nccl     an update group (nccl.py, process_group.py): one broadcast per bucket to every
             engine in it; NCCL when the trainer and every engine in the group are on GPUs,
             gloo when any of them is on a CPU
    tensor   `/update_weights_from_tensor` with a handle to the bucket's bytes: to
             millstream's engine a JSON handle (tensor.py), CUDA IPC when the engine is on the
             trainer's GPU (the one way there: NCCL refuses two ranks on one GPU), shared
             memory when it is on the same machine and either side is on a CPU; to a real
             SGLang server on the trainer's GPU, SGLang's own format over CUDA IPC
             (sglang_format.py: a pickled FlattenedTensorBucket per TP rank), which needs
             sglang importable in the trainer; forced (`tensor`) to an SGLang server the
             launcher started on this machine's CPU, the same format with the bytes in the
             request
    disk     safetensors files in a directory both sides see (--update-weight-disk-dir) and
             `/update_weights_from_disk` (disk.py): slow, and works wherever a file system is
             shared

`auto` (the default) picks per engine, and the start-up line says why: the trainer's GPU ->
tensor (CUDA IPC: millstream's handle, or SGLang's format for an SGLang server `millstream
train` started there, which takes no other handle: the launcher knows where it put it), or
disk for such a server where sglang is not importable in the trainer; the same machine with
either side on a CPU -> tensor (shared memory: bench_weight_sync.py measures it against gloo);
anything else, or an engine that does not say where it lives (a real SGLang server elsewhere)
-> nccl. An engine that lists no `weight_transports` (millstream's engine always does; any
spelling of a route counts, `advertised`) is an SGLang server. `nccl`, `tensor` and `disk`
force one, and a forced one that cannot work for an engine is refused with the reason
(`TransportError`) instead of a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from millstream.common import tensor_share
from millstream.common.weight_routes import DISK, NCCL, TENSOR, advertised

from . import sglang_format
from .base import CUDA_IPC, SGLANG, SGLANG_BYTES, SHM, Bucket, Route, TransportError, on_cpu
from .disk import DiskSender
from .nccl import GroupRoute
from .sglang_format import SglangSender
from .tensor import TensorSender


def choose(
    setting: str,
    trainer: Mapping[str, Any],
    engine: Mapping[str, Any] | None,
    sglang_missing: Callable[[], str | None] = sglang_format.unavailable,
) -> Route:
    """The route to one engine. `trainer` and `engine` are placements
    (tensor_share.placement; an engine's from its /get_server_info, or the launcher's for an
    SGLang server; None when nobody says); `sglang_missing`: why SGLang's format cannot be
    made here (None: it can), asked only for an SGLang server on the trainer's GPU."""
    if setting == DISK:
        return Route(DISK, "--update-weight-transport disk")
    takes_tensors = engine is not None and TENSOR in advertised(engine.get("weight_transports", ()))
    same_gpu = engine is not None and tensor_share.same_gpu(trainer, engine)
    same_host = engine is not None and tensor_share.same_host(trainer, engine)
    sglang = engine is not None and "weight_transports" not in engine
    sglang_here = same_gpu and sglang
    # The launcher's SGLang server on this machine's CPU (tests; a CPU-only trial run)
    sglang_cpu_here = sglang and same_host and engine is not None and on_cpu(engine)
    if setting == NCCL:
        if same_gpu:
            raise TransportError(
                "--update-weight-transport nccl: the engine is on the trainer's GPU, and NCCL "
                "cannot put two ranks on one GPU; use auto (CUDA IPC) or disk"
            )
        return Route(NCCL, "--update-weight-transport nccl")
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
    # auto (config holds `auto` or a route's one name: weight_routes.setting)
    if engine is None:
        return Route(NCCL, "the engine does not say where it lives")
    if same_gpu and takes_tensors:
        return Route(TENSOR, "on the trainer's GPU", CUDA_IPC)
    if sglang_here:  # the launcher put it there: no NCCL (two ranks on one GPU), no our handle
        missing = sglang_missing()
        if missing is None:
            return Route(TENSOR, "an SGLang server on the trainer's GPU", SGLANG)
        return Route(DISK, f"an SGLang server on the trainer's GPU; {missing}")
    if same_gpu:
        return Route(DISK, "on the trainer's GPU, taking no shared tensors (NCCL cannot)")
    if same_host and takes_tensors and (on_cpu(trainer) or on_cpu(engine)):
        return Route(TENSOR, "on this machine, on a CPU", SHM)
    if not same_host:
        return Route(NCCL, "on another machine")
    return Route(NCCL, "on this machine's CPU" if on_cpu(engine) else "on another GPU")


def senders(
    group: GroupRoute, *, disk_dir: Path | None, shm_dir: str
) -> tuple[GroupRoute, TensorSender, SglangSender, DiskSender]:
    """One sender per route, each serving the routes `choose` names it for (Sender.serves);
    `group`: the nccl route's, which the sync also drives (members, drop, release)."""
    return group, TensorSender(shm_dir), SglangSender(), DiskSender(disk_dir)


def trainer_placement(buckets: Sequence[Bucket]) -> dict[str, Any]:
    """Where the trainer's weights live: the first tensor's device (the CPU for none)."""
    device = buckets[0].tensors[0].device if buckets and buckets[0].tensors else torch.device("cpu")
    return tensor_share.placement(device)
