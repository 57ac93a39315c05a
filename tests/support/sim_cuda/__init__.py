"""A CUDA device simulated on the CPU, so that device placement can fail in `make test`.

On a CPU every tensor is on the one device, so code that forgets a `.to(device)` (an index
made on the host and used against a device tensor, a `torch.cat` of a host and a device
tensor) passes every CPU test and fails at its first step on a GPU. Under `simulated_cuda()`
a tensor made on "cuda" is a `SimCuda` tensor: its data is an ordinary CPU tensor, but it
says `device == cuda:0`, and every op that takes it refuses a host tensor beside it where
CUDA refuses one, with CUDA's own message. torch.cuda's queries answer as for one GPU of
compute capability 9.0 (so the sm90 branches run), every thread started inside sees the
same device, and `.numpy()` of a device tensor is refused as on a GPU.

What CUDA accepts beside a device tensor, and so this does too: a host tensor of zero
dimensions (a scalar), host index tensors to advanced indexing (`x[idx]`, `x[idx] = y`),
and a copy between the two (`copy_`, `.to`, `.cpu()`).

CUDA graphs: `torch.cuda.graph` records the ops run inside it (`SimGraph`), and each
`replay()` runs them again on the same tensors, writing into the tensors the capture made,
as a graph replays into the same addresses. Inside a capture, as CUDA refuses them, a read
back to the host (`.item()`, `int()`, `.tolist()`, `.cpu()`) and a copy from pageable host
memory are errors; a copy from pinned memory is recorded and reads the pinned tensor at
each replay.

What it cannot show: memory (the allocator's numbers are zero, `mem_get_info` a fixed small
card), kernels (every op is the CPU's; the CPU's torch has no block-scaled FP8 GEMM), streams
and events (synchronous), CUDA IPC, and autograd: torch's CPU build has no CUDA device guard,
which autograd asks for, so a SimCuda tensor never takes part in a backward (the trainer's
step is not simulated; the engine runs under inference_mode and is). Those stay GPU-marked
tests for `make gpu-check`. Some of torch's Python bindings ask for the guard too (indexing,
`copy_`, `contiguous`, `int()`, `~`, `nonzero`, `new_*`): `Placement` sends those to the op
itself, through the dispatcher.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from .graphs import Event, SimGraph, Stream, capture
from .tensor import TOTAL_BYTES, CaptureError, DeviceMismatch, Placement, SimCuda

__all__ = ["CaptureError", "DeviceMismatch", "SimCuda", "SimGraph", "simulated_cuda"]


def _allocated(*_: Any, **__: Any) -> int:
    return 0


class _Properties:
    name = "simulated CUDA (the CPU)"
    total_memory = TOTAL_BYTES
    major, minor = 9, 0
    multi_processor_count = 132
    uuid = "00000000-51a0-4c0d-a000-000000000000"  # str() of torch's is the GPU's UUID


_module_to = torch.nn.Module.to


def _to_keeping_ties(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Module.to with new Parameters (a SimCuda cannot become the old Parameter's `.data`),
    each tied parameter (lm_head and the embedding) still one object, as `.data =` keeps it."""
    before = [
        (m, key, p) for m in module.modules() for key, p in m._parameters.items() if p is not None
    ]
    out = _module_to(module, *args, **kwargs)
    first: dict[int, torch.nn.Parameter] = {}
    for m, key, old in before:
        m._parameters[key] = first.setdefault(id(old), m._parameters[key])
    return out


@contextlib.contextmanager
def simulated_cuda() -> Iterator[None]:
    """Inside: torch sees one GPU, cuda:0, whose tensors are SimCuda tensors."""
    stream = Stream()
    torch._C._ensureCUDADeviceGuardSet()  # a CUDA build without a GPU: a no-op guard (the
    # CPU build has no CUDA guard to replace, hence the bindings Placement reroutes)
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda *_: None,
        "synchronize": lambda *_: None,
        "empty_cache": lambda: None,
        "ipc_collect": lambda: None,
        "mem_get_info": lambda *_: (TOTAL_BYTES * 3 // 4, TOTAL_BYTES),  # a quarter in use
        "memory_allocated": _allocated,
        "memory_reserved": _allocated,
        "max_memory_allocated": _allocated,
        "max_memory_reserved": _allocated,
        "reset_peak_memory_stats": lambda *_: None,
        "get_device_capability": lambda *_: (9, 0),
        "get_device_name": lambda *_: _Properties.name,
        "get_device_properties": lambda *_: _Properties(),
        "is_bf16_supported": lambda *_, **__: True,
        "current_stream": lambda *_: stream,
        "default_stream": lambda *_: stream,
        "Stream": Stream,
        "Event": Event,
        "stream": lambda *_: contextlib.nullcontext(),
        "CUDAGraph": SimGraph,
        "graph": capture,
        "graph_pool_handle": lambda: object(),
    }
    with contextlib.ExitStack() as stack:
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value, create=True))
        # Module.to makes new Parameters (SimCuda ones) instead of setting `.data` on the old.
        overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        stack.callback(torch.__future__.set_overwrite_module_params_on_conversion, overwrite)
        stack.enter_context(mock.patch.object(torch.nn.Module, "to", _to_keeping_ties))
        stack.enter_context(Placement())
        # The mode is per thread: every thread started inside (the engine's scheduler, an
        # executor's workers) enters it too.
        bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

        def inside(thread: threading.Thread) -> None:
            with Placement():
                bootstrap(thread)

        stack.enter_context(mock.patch.object(threading.Thread, "_bootstrap_inner", inside))
        yield
