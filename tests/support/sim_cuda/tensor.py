"""Tensors on the simulated device (the package's docstring): SimCuda, the device check, and
the function mode that puts "cuda" tensors there."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
TOTAL_BYTES = 2**30  # the card mem_get_info describes: small, as a KV pool sized from it is
# allocated in host memory

# Ops that take host tensors beside device ones on a real GPU (besides 0-dim ones).
_HOST_INDEX_OK = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_CROSS_DEVICE = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize"}


class DeviceMismatch(RuntimeError):
    """What CUDA raises when an op gets tensors on two devices."""


class SimCuda(torch.Tensor):
    """A tensor that says it is on cuda:0 and holds its data in a CPU tensor (`elem`)."""

    elem: torch.Tensor
    __slots__ = ("elem",)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> SimCuda:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=CUDA,
        )
        out.elem = elem
        return out

    def __repr__(self) -> str:
        return f"SimCuda({self.elem!r})"

    # `param.data = value` reaches no torch function mode: the setter keeps `elem` in step.
    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _set_data(self, value)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        if name not in _CROSS_DEVICE:
            _check_devices(name, args, kwargs)
        if name == "aten::_to_copy" and to_host(kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
            return func(*tree_map(_unwrap, args), **kwargs)
        if name == "aten::_local_scalar_dense":
            return func(*tree_map(_unwrap, args), **kwargs)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, _host_kwargs(kwargs)))
        if name in ("aten::copy_", "aten::_copy_from"):
            return args[0] if name == "aten::copy_" else out
        return tree_map(_wrap, out)


def _unwrap(x: Any) -> Any:
    return x.elem if isinstance(x, SimCuda) else x


def _wrap(x: Any) -> Any:
    if not isinstance(x, torch.Tensor) or isinstance(x, SimCuda):
        return x
    # Made as a normal tensor even under inference_mode: torch then marks a view of a normal
    # base as a view of it, which an inference tensor cannot be (a plain tensor's view is
    # made by its own kernel, never by a Python one).
    with torch.inference_mode(False):
        return SimCuda(x)


def is_cuda_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def to_host(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def _host_kwargs(kwargs: dict) -> dict:
    if is_cuda_device(kwargs.get("device")):
        kwargs = {**kwargs, "device": CPU}
    if kwargs.get("pin_memory"):
        kwargs = {**kwargs, "pin_memory": False}
    return kwargs


def _check_devices(name: str, args: Any, kwargs: Any) -> None:
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if not any(isinstance(t, SimCuda) for t in tensors):
        return
    if name in _HOST_INDEX_OK:  # the indices may be on the host; self and values may not
        tensors = [args[0], *[a for a in args[2:] if isinstance(a, torch.Tensor)]]
    for t in tensors:
        if not isinstance(t, SimCuda) and t.dim() > 0:
            raise DeviceMismatch(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, cuda:0 and {t.device}! (in {name}, a host tensor of shape "
                f"{tuple(t.shape)})"
            )


# Host tensors made "pinned" (by id: a tensor's == is elementwise), let go with them.
_PINNED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _pin(t: torch.Tensor) -> None:
    _PINNED[id(t)] = t


def is_pinned_host(t: torch.Tensor) -> bool:
    return _PINNED.get(id(t)) is t


STATE: dict[str, Any] = {}  # "capturing": a graph capture is under way (graphs.py)

_FACTORIES_LIKE = {
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like,
}  # fmt: skip


_SCALARS = {
    torch.Tensor.item: lambda v: v,
    torch.Tensor.__int__: int,
    torch.Tensor.__index__: int,
    torch.Tensor.__float__: float,
    torch.Tensor.__bool__: bool,
}
_STORAGE = {torch.Tensor.untyped_storage, torch.Tensor.storage, torch.Tensor.data_ptr}
_NEW = {"new", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided"}


def _basic_index(x: torch.Tensor, index: Any) -> tuple[torch.Tensor, list]:
    """Python's indexing as torch applies it (ints select, slices narrow, None adds a dim,
    Ellipsis spans the rest), done with ops that reach __torch_dispatch__: torch's own
    indexing code wants a CUDA device guard, which its CPU build lacks. Returns the view
    and, if any index is a tensor or a list, the per-dim indices for aten.index."""
    items = list(index) if isinstance(index, tuple) else [index]
    items = [torch.tensor(i) if isinstance(i, list) else i for i in items]
    used = sum(
        1 if not isinstance(i, torch.Tensor) or i.dtype != torch.bool else i.dim()
        for i in items
        if i is not None and i is not Ellipsis
    )
    view, dim, advanced = x, 0, []
    for item in items:
        if item is Ellipsis:
            skip = x.dim() - used
            dim += skip
            advanced += [None] * skip
        elif item is None:
            view = view.unsqueeze(dim)
            dim += 1
            advanced.append(None)
        elif isinstance(item, bool):
            raise NotImplementedError("simulated CUDA: a bool as an index")
        elif isinstance(item, int) or (
            isinstance(item, torch.Tensor)
            and item.dim() == 0
            and item.dtype != torch.bool
            and not item.is_floating_point()
            and not isinstance(item, SimCuda)
        ):
            view = view.select(dim, int(item))
        elif isinstance(item, slice):
            start, stop, step = item.indices(view.shape[dim])
            view = torch.ops.aten.slice.Tensor(view, dim, start, stop, step)
            dim += 1
            advanced.append(None)
        elif isinstance(item, torch.Tensor):
            advanced.append(item)
            dim += item.dim() if item.dtype == torch.bool else 1
            advanced += [None] * (item.dim() - 1 if item.dtype == torch.bool else 0)
        else:
            raise NotImplementedError(f"simulated CUDA: an index of type {type(item)}")
    while advanced and advanced[-1] is None:
        advanced.pop()
    return view, advanced


# Calls on a tensor that requires grad which build no autograd graph.
_NO_GRAPH = {
    "__get__", "__set__", "__repr__", "__format__", "__len__", "__hash__", "__bool__",
    "__reduce_ex__", "__deepcopy__", "detach", "detach_", "requires_grad_", "size", "dim",
    "numel", "stride", "storage_offset", "is_contiguous", "element_size", "untyped_storage",
    "data_ptr", "item", "tolist", "is_pinned", "is_floating_point", "is_complex", "is_signed",
    "get_device", "type",
}  # fmt: skip


def _records_grad(args: Any, kwargs: Any) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    return any(isinstance(t, SimCuda) and t.requires_grad for t in flat)


class Placement(TorchFunctionMode):
    """Turns "cuda" in a factory call or a move into SimCuda tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if (
            torch.is_grad_enabled()
            and func.__name__ not in _NO_GRAPH
            and getattr(func, "__module__", None) != "torch.nn.init"  # it runs under no_grad
            and _records_grad(args, kwargs)
        ):
            raise RuntimeError(
                f"simulated CUDA: {getattr(func, '__name__', func)} would record a device tensor "
                "for autograd, which torch's CPU build cannot run on a CUDA tensor (it aborts "
                "the process): run it under torch.no_grad() or on a GPU (make gpu-check)"
            )
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return _move(func, args, kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], SimCuda):
            view, indices = _basic_index(args[0], args[1])
            return torch.ops.aten.index.Tensor(view, indices) if indices else view
        if func is torch.Tensor.__setitem__ and isinstance(args[0], SimCuda):
            view, indices = _basic_index(args[0], args[1])
            value = args[2]
            if indices:
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value, dtype=view.dtype)
                torch.ops.aten.index_put_(view, indices, value)
            elif isinstance(value, torch.Tensor):
                torch.ops.aten.copy_.default(view, value)
            else:
                view.fill_(value)
            return None
        if func.__name__ in _NEW and isinstance(args[0], SimCuda):
            return _wrap(func(args[0].elem, *args[1:], **_host_kwargs(kwargs)))
        # Their Python bindings want CUDA's device guard, which torch's CPU build lacks: the
        # op itself, through the dispatcher.
        if func is torch.Tensor.copy_:
            return torch.ops.aten.copy_.default(*args, **kwargs)
        if func is torch.Tensor.__invert__ and isinstance(args[0], SimCuda):
            return torch.ops.aten.bitwise_not.default(args[0])
        if func is torch.Tensor.contiguous and isinstance(args[0], SimCuda):
            return torch.ops.aten.contiguous.default(*args, **kwargs)
        if func in _SCALARS and isinstance(args[0], SimCuda):
            return _SCALARS[func](torch.ops.aten._local_scalar_dense.default(args[0]))
        if func in (torch.Tensor.nonzero, torch.nonzero) and isinstance(args[0], SimCuda):
            out = torch.ops.aten.nonzero.default(args[0])
            return out.unbind(1) if kwargs.get("as_tuple") else out
        if func in _STORAGE and isinstance(args[0], SimCuda):  # identity: the host data's
            return func(args[0].elem, *args[1:], **kwargs)
        if func is torch.Tensor.tolist:
            if STATE.get("capturing") and isinstance(args[0], SimCuda):
                raise CaptureError("operation not permitted when stream is capturing (.tolist())")
            return _unwrap(args[0]).tolist()
        if func is torch.Tensor.numpy and isinstance(args[0], SimCuda):
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                "the tensor to host memory first."
            )
        if func is torch.Tensor.pin_memory:
            out = _unwrap(args[0]).clone()
            _pin(out)
            return out
        if func is torch.Tensor.is_pinned:
            return is_pinned_host(args[0])
        pin = bool(kwargs.pop("pin_memory", False))
        device = kwargs.get("device")
        if device is None and func in _FACTORIES_LIKE and isinstance(args[0], SimCuda):
            device = CUDA
        if is_cuda_device(device):
            if STATE.get("capturing") and func in (torch.tensor, torch.as_tensor):
                raise CaptureError(
                    f"operation not permitted when stream is capturing ({func.__name__} from "
                    "host data inside a CUDA graph capture)"
                )
            kwargs["device"] = CPU
            args = tree_map(_unwrap, args)
            return tree_map(_wrap, func(*args, **kwargs))
        out = func(*args, **kwargs)
        if pin and isinstance(out, torch.Tensor):
            _pin(out)
        return out


def _move(func: Any, args: Any, kwargs: dict) -> Any:
    """Tensor.to / .cuda / .cpu: to or from the simulated device (a copy, as between two
    devices), else as torch does."""
    x, rest = args[0], list(args[1:])
    target = kwargs.get("device")
    dtype = kwargs.get("dtype")
    if func is torch.Tensor.cuda:
        target = CUDA
    elif func is torch.Tensor.cpu:
        target = CPU
    for a in rest:
        if isinstance(a, (str, torch.device)):
            target = a
        elif isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            target, dtype = a.device, a.dtype
    data = _unwrap(x)
    if dtype is not None and dtype != data.dtype:
        data = data.to(dtype)
    on_cuda = isinstance(x, SimCuda) if target is None else torch.device(target).type == "cuda"
    if on_cuda == isinstance(x, SimCuda):  # no move: as torch, the same tensor unless cast
        return x if data is _unwrap(x) else _wrap(data) if on_cuda else data
    if on_cuda:  # host to device: a copy_ the dispatch sees (and a capture records)
        out = _wrap(torch.empty_like(data))
        torch.ops.aten.copy_.default(out, data)
        return out
    return torch.ops.aten._to_copy.default(x if data is x.elem else _wrap(data), device=CPU)


def _set_data(target: torch.Tensor, value: torch.Tensor) -> None:
    """`param.data = value`: a SimCuda keeps its `elem` in step with what it says."""
    if isinstance(target, SimCuda) != isinstance(value, SimCuda):
        raise RuntimeError(
            "simulated CUDA: `.data =` across devices changes a tensor's class; "
            f"{target.device} <- {value.device}"
        )
    torch._C.TensorBase.data.__set__(target, value)
    if isinstance(target, SimCuda):
        target.elem = value.elem


class CaptureError(RuntimeError):
    """What CUDA raises for work a graph capture cannot hold."""
