"""New weights for a running engine: update groups, receiving, decoding, and loading.

Update groups (`/init_weights_update_group`). The trainer's rank 0 and every engine rank form
a process group of their own, separate from any default group, so one process can hold
several (one per group_name). The rendezvous is the one SGLang's `init_custom_process_group`
does, so a trainer written for SGLang engines works unchanged against this one:
    store = TCPStore(master_address, master_port), hosted by rank 0 (the trainer);
    PrefixStore(group_name, store);
    torch's `_new_process_group_helper(world_size, rank, [], backend, store, group_name)`.
The engine's rank is `rank_offset` (a CPU engine has one rank). gloo on CPU, nccl only
where CUDA exists. Every collective has the group's timeout (--weight-update-timeout).

Distributed update (`/update_weights_from_distributed`): for each (name, dtype, shape), in
order, receive `broadcast(src=0)` into a fresh tensor on the group's device: the engine's GPU
for nccl (as SGLang receives, straight into device tensors: no round trip through host
memory), the CPU for gloo. Receiving happens off the scheduler thread, so decoding goes on
meanwhile; the copy into the model's parameters then runs as ONE scheduler command between
two steps, so no step ever sees half of an update, and the weight version changes in the
same command.

`/update_weights_from_tensor` differs from SGLang on purpose: SGLang pickles tensors, and
nothing on our wire is pickled (docs/architecture.md). `serialized_named_tensors` here is a
list of base64 strings, each a safetensors blob (`safetensors.torch.save({name: tensor})`),
decoded without executing anything.

`/update_weights_from_disk` reads every `*.safetensors` file in `model_path`.

Every update reports the parameters it wrote (`WeightLoader.copy_in`): after a resume the
weights are garbage until updates have written all of them (executor/model_runner.py).
"""

from __future__ import annotations

import base64
import binascii
import inspect
import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .quant import fp8
from .scheduler import RequestError

log = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


def parse_dtype(text: str) -> torch.dtype:
    name = text.removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RequestError(f"dtypes: {text!r} is not a torch dtype (e.g. 'bfloat16')")
    return dtype


@dataclass
class _Group:
    pg: Any
    rank: int
    world_size: int
    device: torch.device
    timeout: timedelta
    # One receive at a time per group: two interleaving their broadcasts would corrupt both.
    # Per group, not per engine: a group the trainer gave up on (its rank 0 timed out behind
    # a network partition) leaves its receive here until the group's timeout, and the next
    # group's receives must not wait behind it.
    lock: threading.Lock = field(default_factory=threading.Lock)


def _new_group(
    address: str, port: int, rank: int, world_size: int, name: str, backend: str, timeout: timedelta
) -> Any:
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(
        rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(name, store)
    # The helper's options keyword was renamed across torch versions.
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=name,
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class UpdateGroups:
    """Named process groups this engine receives weights on. Blocking methods: call them
    from a worker thread, never the event loop."""

    def __init__(self, timeout_s: float, device: torch.device | str = "cpu"):
        self._timeout = timedelta(seconds=timeout_s)
        self._device = torch.device(device)  # the model's: where an nccl group receives
        self._groups: dict[str, _Group] = {}

    @property
    def names(self) -> list[str]:
        return sorted(self._groups)

    def init(
        self, address: str, port: int, rank: int, world_size: int, name: str, backend: str
    ) -> None:
        if name in self._groups:
            raise RequestError(f"group_name: {name!r} exists; destroy it first")
        if rank >= world_size:
            raise RequestError(f"rank_offset: {rank} must be < world_size {world_size}")
        if backend == "nccl" and self._device.type != "cuda":
            raise RequestError(
                f"backend: nccl needs CUDA and this engine runs on {self._device}; use gloo"
            )
        device = self._device if backend == "nccl" else torch.device("cpu")
        pg = _new_group(address, port, rank, world_size, name, backend, self._timeout)
        self._groups[name] = _Group(pg, rank, world_size, device, self._timeout)
        log.info(
            "joined weight update group %r as rank %d of %d (%s)", name, rank, world_size, backend
        )

    def destroy(self, name: str) -> None:
        group = self._groups.pop(name, None)
        if group is None:
            raise RequestError(f"group_name: no update group {name!r} (have {self.names})")
        torch.distributed.destroy_process_group(group.pg)
        log.info("left weight update group %r", name)

    def receive(
        self,
        name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        flattened: bool = False,
    ) -> NamedTensors:
        """The tensors of one bucket: one broadcast each, or (`flattened`, SGLang's
        flattened_bucket) one broadcast of all their bytes back to back, in order."""
        group = self._groups.get(name)
        if group is None:
            raise RequestError(f"group_name: no update group {name!r} (have {self.names})")
        specs = [(n, parse_dtype(d), s) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        with group.lock:
            return receive_broadcast(group.pg, specs, group.device, flattened, group.timeout)


def receive_broadcast(
    pg: Any,
    specs: list[tuple[str, torch.dtype, list[int]]],
    device: torch.device,
    flattened: bool,
    timeout: timedelta,
) -> NamedTensors:
    """One bucket received from rank 0 of `pg` into tensors on `device`, where they stay:
    the weight loader copies them into the parameters from there."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    if not flattened:
        out: NamedTensors = []
        for tensor_name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            pg.broadcast([tensor], opts).wait(timeout)
            out.append((tensor_name, tensor))
        _arrived(device)
        return out
    nbytes = sum(torch.Size(s).numel() * d.itemsize for _, d, s in specs)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pg.broadcast([flat], opts).wait(timeout)
    _arrived(device)
    return unflatten_bytes(flat, specs)


def _arrived(device: torch.device) -> None:
    """Wait until the bytes are here. An nccl wait only orders this thread's stream after the
    broadcast; blocking here (off the event loop, under --weight-update-timeout) keeps a
    sender that never comes from stalling the engine's stream behind the copy-in."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def unflatten_bytes(
    flat: torch.Tensor, specs: list[tuple[str, torch.dtype, list[int]]]
) -> NamedTensors:
    """SGLang's flattened_bucket layout read back: each (name, dtype, shape)'s bytes, in order."""
    out: NamedTensors = []
    start = 0
    for name, dtype, shape in specs:
        size = torch.Size(shape).numel() * dtype.itemsize
        if start + size > flat.numel():
            raise RequestError(f"flattened bucket: {flat.numel()} bytes, too few for {name}")
        piece = flat[start : start + size]
        if start % dtype.itemsize:  # a view at such an offset is refused: copy those bytes
            piece = piece.clone()
        out.append((name, piece.view(dtype).reshape(shape)))
        start += size
    return out


def decode_tensor_blobs(blobs: list[str]) -> NamedTensors:
    from safetensors.torch import load as load_safetensors

    out: NamedTensors = []
    for i, blob in enumerate(blobs):
        try:
            raw = base64.b64decode(blob, validate=True)
            out.extend(load_safetensors(raw).items())
        except (binascii.Error, ValueError, RuntimeError) as err:
            raise RequestError(
                f"serialized_named_tensors[{i}]: not a base64 safetensors blob ({err})"
            ) from err
    return out


def read_safetensors_dir(model_path: str) -> NamedTensors:
    from safetensors.torch import load_file

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise RequestError(f"model_path: no *.safetensors files in {model_path}")
    out: NamedTensors = []
    for file in files:
        out.extend(load_file(file).items())
    return out


class WeightLoader:
    """Checks named tensors against the model and copies them in (scheduler thread).

    An FP8 layer (quant/fp8.py) takes its weight in full precision, of the full [out, in] shape,
    cast to FP8 here; or already in FP8 with its `weight_scale_inv` in the same update
    (Miles' megatron sender quantizes before sending)."""

    def __init__(self, model: torch.nn.Module):
        self._params = dict(model.named_parameters(remove_duplicate=False))
        # Shapes as loaded: a released parameter's data is empty (executor/model_runner.py).
        self._shapes = {name: list(p.shape) for name, p in self._params.items()}
        self._fp8 = fp8.fp8_layers(model)

    def check_specs(self, names: list[str], shapes: list[list[int]]) -> None:
        unknown = [n for n in names if n not in self._params]
        if unknown:
            raise RequestError(f"names: not parameters of this model: {unknown[:5]}")
        for name, shape in zip(names, shapes, strict=True):
            if self._shapes[name] != list(shape):
                raise RequestError(f"shapes: {name} is {self._shapes[name]} here, got {shape}")

    def check(self, tensors: NamedTensors) -> None:
        self.check_specs([n for n, _ in tensors], [list(t.shape) for _, t in tensors])
        if why := fp8.update_refusal(self._fp8, tensors):
            raise RequestError(why)

    def copy_in(self, tensors: NamedTensors) -> list[torch.nn.Parameter]:
        """Copy `tensors` into the parameters (from any device); returns those written (an
        FP8 weight writes its scales too; a tied parameter is written under either name)."""
        given = dict(tensors)
        written: list[torch.nn.Parameter] = []
        with torch.no_grad():
            for name, tensor in tensors:
                layer = self._fp8.get(name)
                if layer is None:
                    if not fp8.is_scale_of(name, self._fp8):  # a scale goes with its weight
                        self._params[name].copy_(tensor)
                        written.append(self._params[name])
                    continue
                if tensor.dtype == fp8.FP8_DTYPE:
                    layer.load_quantized(tensor, given[name + fp8.SCALE_SUFFIX])
                else:
                    layer.load_full(tensor)
                written += [layer.weight, layer.weight_scale_inv]
        return written
