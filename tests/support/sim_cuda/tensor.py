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

    elem: torch.Tensor  # in __dict__, not a slot: a host tensor that becomes a device one
    # in place (`move_in_place`) has none
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

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (torch.save) as torch pickles a CUDA tensor: its data, in a storage whose
        location reads "cuda:0" (`saved_location`)."""
        DEVICE_STORAGES.add(self.elem.untyped_storage())
        return self.elem.__reduce_ex__(protocol)

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


# The storages of device tensors torch.save met: their location is "cuda:0" (`saved_location`).
DEVICE_STORAGES: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()


def saved_location(storage: Any) -> str | None:
    """torch.serialization's location tag: "cuda:0" for a device tensor's storage, as a GPU
    writes it, so that a checkpoint made here loads as one from a GPU does (on the CPU, only
    with a map_location)."""
    return "cuda:0" if storage in DEVICE_STORAGES else None


def restored(storage: Any, location: str) -> Any:
    """torch.load of a "cuda" location inside the simulation: the host storage (a plain
    tensor, where a GPU would give a device one; load_state_dict moves it)."""
    return storage if location.startswith("cuda") else None


# Host tensors made "pinned" (by id: a tensor's == is elementwise), let go with them.
_PINNED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _pin(t: torch.Tensor) -> None:
    _PINNED[id(t)] = t


def is_pinned_host(t: torch.Tensor) -> bool:
    return _PINNED.get(id(t)) is t


# "capturing": a graph capture is under way, "recorded": its list of ops (graphs.py)
STATE: dict[str, Any] = {}

_FACTORIES_LIKE = {
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like,
}  # fmt: skip


_STORAGE = {torch.Tensor.untyped_storage, torch.Tensor.storage, torch.Tensor.data_ptr}


class Placement(TorchFunctionMode):
    """Turns "cuda" in a factory call or a move into SimCuda tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return _move(func, args, kwargs)
        if _is_data_setter(func):  # a host tensor's `.data = ` (a SimCuda's is its property)
            _set_data(*args)
            return None
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

            def make() -> Any:
                return tree_map(_wrap, func(*args, **kwargs))

            out = make()
            if STATE.get("capturing"):  # a kernel that fills it: each replay makes it again
                STATE["recorded"].append((make, (), {}, out))
            return out
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
    cast = {} if dtype is None or dtype == x.dtype else {"dtype": dtype}
    on_cuda = isinstance(x, SimCuda) if target is None else torch.device(target).type == "cuda"
    if on_cuda == isinstance(x, SimCuda):  # no move: as torch, the same tensor unless cast
        return torch.ops.aten._to_copy.default(x, **cast) if cast else x
    if on_cuda:  # host to device: a copy_ the dispatch sees (and a capture records)
        data = x.to(**cast) if cast else x
        out = _wrap(torch.empty_like(_unwrap(data)))
        torch.ops.aten.copy_.default(out, data)
        return out
    return torch.ops.aten._to_copy.default(x, device=CPU, **cast)


def _is_data_setter(func: Any) -> bool:
    return (
        getattr(func, "__name__", None) == "__set__"
        and getattr(func, "__self__", None) is torch._C.TensorBase.__dict__["data"]
    )


def apply_in_place(module: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    """Module._apply (`to`, `cuda`, `half`...) as it runs with CUDA: each parameter stays
    the same object and takes its converted data by `.data =`, across devices too
    (`move_in_place`), so an optimizer built before the move, a tied lm_head, and hooks
    added after it all hold the module's parameters. torch's own takes another path for a
    tensor subclass (a new Parameter, or swapping everything, hooks included)."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    for param in module._parameters.values():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        if applied is not param:
            _set_data(param, applied)
        if param.grad is not None:
            with torch.no_grad():
                grad = fn(param.grad)
            if grad is not param.grad:
                _set_data(param.grad, grad)
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)
    return module


def _set_data(target: torch.Tensor, value: torch.Tensor) -> None:
    """`param.data = value`: a SimCuda keeps its `elem` in step with what it says; across
    devices the tensor changes class in place (`move_in_place`)."""
    if isinstance(target, SimCuda) != isinstance(value, SimCuda):
        move_in_place(target, value)
        return
    torch._C.TensorBase.data.__set__(target, value)
    if isinstance(target, SimCuda):
        target.elem = value.elem


def move_in_place(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target.data = value` between the host and the device: `target` stays the same Python
    object (the Parameter an optimizer or a tied module holds, with its attributes) and takes
    `value`'s data, device and class, as `.data =` moves a tensor between devices on a GPU.

    torch's CPU build cannot put a device tensor's data under a host tensor's autograd
    identity (they are different tensor types), so the two exchange their insides
    (torch.utils.swap_tensors) and `target` keeps its own attributes and its post-accumulate
    hooks (--bf16's, precision.py). What that cannot carry over is refused: a gradient and
    backward hooks (a GPU keeps them)."""
    if target.grad is not None or target._backward_hooks:
        raise RuntimeError(
            "simulated CUDA: moving a tensor between the host and the device in place keeps "
            "neither its .grad nor its backward hooks here (a GPU would)"
        )
    was_param = isinstance(target, torch.nn.Parameter)
    _PINNED.pop(id(target), None)  # (a weak reference: swap_tensors refuses those)
    pinned = is_pinned_host(value)
    own = {k: v for k, v in target.__dict__.items() if k != "elem"}
    hooks = target._post_accumulate_grad_hooks
    carrier = value.detach().requires_grad_(target.requires_grad)
    torch.utils.swap_tensors(target, carrier)
    target.__dict__.update(own)
    if pinned:  # pinned is a property of the memory, which `target` now holds
        _pin(target)
    if hooks is not None:  # registered on the tensor's insides, which went to the carrier
        carrier._post_accumulate_grad_hooks = None
        target._post_accumulate_grad_hooks = hooks
    if isinstance(target, SimCuda):
        target._is_param = was_param  # torch's mark of a Parameter that is a subclass
    else:
        target.__dict__.pop("elem", None)
        target.__dict__.pop("_is_param", None)
        if was_param:
            target.__class__ = torch.nn.Parameter


def device_factories() -> torch.library.Library:
    """CUDA kernels for torch's two allocating ops, which make SimCuda tensors. A composite
    op's C++ (scaled_dot_product_attention's, say) makes its new tensors from its inputs'
    options, a call no Python mode sees, which torch's CPU build has no CUDA kernel for.
    Registered until the library is destroyed."""
    lib = torch.library.Library("aten", "IMPL", "CUDA")

    def empty(size: Any, dtype: Any = None, layout: Any = None, device: Any = None,
              pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:  # fmt: skip
        return _wrap(torch.empty(size, dtype=dtype, memory_format=memory_format))

    def empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None,
                      device: Any = None, pin_memory: Any = None) -> torch.Tensor:  # fmt: skip
        return _wrap(torch.empty_strided(size, stride, dtype=dtype))

    lib.impl("empty.memory_format", empty)
    lib.impl("empty_strided", empty_strided)
    return lib


class CaptureError(RuntimeError):
    """What CUDA raises for work a graph capture cannot hold."""
