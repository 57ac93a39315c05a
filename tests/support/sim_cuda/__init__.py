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

Training runs on it too. torch's CPU build lacks what CUDA's bindings and autograd ask for:
a device guard, and hooks that say CUDA is there (the autograd engine asks them for the
stream of a gradient). native.cpp supplies both while a simulation runs, built once by
native.py with the machine's g++, so indexing, `int()` and the rest take their CUDA paths
and a backward runs (on the thread that calls it). Moves keep their objects as on a GPU:
Module.to and `.data =` leave each Parameter the same object (the one an optimizer holds),
across devices too, with its post-accumulate hooks (`apply_in_place`, `move_in_place`), so
--offload-train's round trip runs; a C++ composite op that allocates from its inputs'
options gets device tensors (`device_factories`); torch.save writes a device tensor's
location as "cuda:0", as a GPU does.

CUDA graphs: `torch.cuda.graph` records the ops run inside it (`SimGraph`), and each
`replay()` runs them again on the same tensors, writing into the tensors the capture made
(those a factory made inside it too), as a graph replays into the same addresses. Inside a
capture, as CUDA refuses them, a read back to the host (`.item()`, `int()`, `.tolist()`,
`.cpu()`) and a copy from pageable host memory are errors; a copy from pinned memory is
recorded and reads the pinned tensor at each replay.

What it cannot show: memory (the allocator's numbers are zero, `mem_get_info` a fixed small
card), kernels (every op is the CPU's: attention takes torch's math path where the CPU has a
flash kernel, so bf16 results differ in their last bits; there is no block-scaled FP8 GEMM),
streams and events (synchronous), CUDA IPC and NCCL. Those stay GPU-marked tests for `make
gpu-check`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from . import native
from .graphs import Event, SimGraph, Stream, capture
from .tensor import (
    TOTAL_BYTES,
    CaptureError,
    DeviceMismatch,
    Placement,
    SimCuda,
    apply_in_place,
    device_factories,
    restored,
    saved_location,
)

__all__ = ["CaptureError", "DeviceMismatch", "SimCuda", "SimGraph", "simulated_cuda"]


def _allocated(*_: Any, **__: Any) -> int:
    return 0


class _Properties:
    name = "simulated CUDA (the CPU)"
    total_memory = TOTAL_BYTES
    major, minor = 9, 0
    multi_processor_count = 132
    uuid = "00000000-51a0-4c0d-a000-000000000000"  # str() of torch's is the GPU's UUID


@contextlib.contextmanager
def simulated_cuda() -> Iterator[None]:
    """Inside: torch sees one GPU, cuda:0, whose tensors are SimCuda tensors."""
    stream = Stream()
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
        "_lazy_init": lambda: None,  # what torch's C++ calls first when it meets the device
    }
    accelerator = {
        "current_device_index": lambda: 0,
        "current_stream": lambda *_: stream,
        "synchronize": lambda *_: None,
        "device_count": lambda: 1,
    }
    with contextlib.ExitStack() as stack:
        native.enable(True)  # autograd's CUDA device guard and hooks (native.cpp)
        stack.callback(native.enable, False)
        stack.callback(device_factories()._destroy)  # CUDA kernels for empty/empty_strided
        # torch.save's location tag for device tensors ("cuda:0"), and torch.load's for it.
        torch.serialization.register_package(5, saved_location, restored)
        stack.callback(torch.serialization._package_registry.remove, (5, saved_location, restored))
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value, create=True))
        for name, value in accelerator.items():
            stack.enter_context(mock.patch.object(torch.accelerator, name, value))
        stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", apply_in_place))
        stack.enter_context(Placement())
        # A backward runs on the thread that calls it: the autograd engine's per-device
        # threads were sized at the process's first backward, maybe before any guard was here.
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        # The mode is per thread: every thread started inside (the engine's scheduler, an
        # executor's workers) enters it too.
        bootstrap = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

        def inside(thread: threading.Thread) -> None:
            with Placement(), torch.autograd.set_multithreading_enabled(False):
                bootstrap(thread)

        stack.enter_context(mock.patch.object(threading.Thread, "_bootstrap_inner", inside))
        yield
