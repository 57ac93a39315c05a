"""CUDA graphs, streams and events on the simulated device (the package's docstring)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .tensor import CUDA, STATE, CaptureError, SimCuda, is_cuda_device, is_pinned_host, to_host


class Event:
    def __init__(self, *_: Any, **__: Any) -> None:
        self._time = 0.0

    def record(self, *_: Any) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, *_: Any) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        return (end._time - self._time) * 1000


class Stream:
    def __init__(self, *_: Any, **__: Any) -> None:
        self.device = CUDA

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *_: Any) -> None:
        pass

    def wait_event(self, *_: Any) -> None:
        pass

    def is_capturing(self) -> bool:
        return bool(STATE.get("capturing"))

    def record_event(self, event: Any = None) -> Event:
        event = event or Event()
        event.record()
        return event


class _Recorder(TorchDispatchMode):
    """Records every op while a graph is captured. Like CUDA's capture it refuses a read
    back to the host (`.item()`, `.tolist()`, `.cpu()`: a synchronization) and a copy from
    pageable host memory (synchronous); a copy from pinned memory is recorded, and its
    replay reads the pinned tensor as it is then."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(t, SimCuda) for t in flat) or is_cuda_device(kwargs.get("device")):
            if name == "aten::_local_scalar_dense" or (
                name == "aten::_to_copy" and to_host(kwargs)
            ):
                raise CaptureError(
                    f"operation not permitted when stream is capturing ({name}: a read back "
                    "to the host inside a CUDA graph capture)"
                )
            if name in ("aten::_to_copy", "aten::copy_", "aten::lift_fresh"):
                pageable = [
                    t
                    for t in flat
                    if isinstance(t, torch.Tensor)
                    and not isinstance(t, SimCuda)
                    and t.dim() > 0
                    and not is_pinned_host(t)
                ]
                if pageable:
                    raise CaptureError(
                        "operation not permitted when stream is capturing (a copy from "
                        f"pageable host memory, shape {tuple(pageable[0].shape)}, inside a "
                        "CUDA graph capture)"
                    )
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class SimGraph:
    """torch.cuda.CUDAGraph simulated: capture records the ops (`_Recorder`); each replay runs
    them again on the same tensors, writing into the tensors the capture made, as a graph
    replays into the same addresses. Nothing else (host code, Python state) is replayed."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.ops: list[tuple[Any, Any, Any, Any]] | None = None
        self.replays = 0

    def replay(self) -> None:
        if self.ops is None:
            raise RuntimeError("simulated CUDA: replay of a graph never captured")
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0], strict=True):
                if isinstance(old, SimCuda) and old is not new:
                    old.elem.copy_(new.elem)


@contextlib.contextmanager
def capture(graph: SimGraph, *_: Any, **__: Any) -> Iterator[None]:
    recorder = _Recorder()
    STATE["capturing"], STATE["recorded"] = True, recorder.ops
    try:
        with recorder:
            yield
    finally:
        STATE["capturing"], STATE["recorded"] = False, None
    graph.ops = recorder.ops
