"""--offload-train: the trainer's GPU state goes to host memory while colocated engines generate.

    offload = TrainOffload(backend)
    offload.to_host()            between steps: every model's parameters and buffers (actor,
                                 reference, teacher, critic), the --bf16 fp32 masters and
                                 every optimizer's state, into pinned host buffers; the
                                 gradients dropped; the GPU's cache handed back to the driver
                                 for the engine
    offload.to_device()          before the next step: all of it back, the same tensors

Parameters keep their identity (their `.data` is swapped, as `Module.to` does), so the
optimizers, the --bf16 gradient hooks and the weight sync's views all still hold them. An
optimizer's state tensors move only when they live on the device (Adam's `step` counters
are scalars: a few bytes, left where torch put them).

What does not travel, and why:

- gradients. `to_host` comes after the optimizer steps and the weight sync, and every step
  starts with `zero_grad(set_to_none=True)` (the critic's too), so a gradient held across an
  offload is never read again: the parameters' (fp32 training), the masters' (--bf16: the
  hooks of precision.py sum each bf16 gradient into its master's `.grad` and drop the bf16
  one). Setting them to None instead of copying them saves two PCIe copies of up to the
  size of the weights (fp32: as much as the parameters) per step; the next backward
  allocates them again, on the device, as the first backward did. The CPU drops them too
  (no copy either way), so every colocated run of `make test` exercises it.
- host buffers. Each tensor's pinned host buffer is allocated at its first offload and
  reused by every later one (again only when its shape or dtype changed, or it is new: Adam's
  state appears at the first step). Fresh `pin_memory` tensors at every offload would come
  from torch's caching host allocator, which can serve them again only from blocks freed and
  whose copies it has seen complete, and pays a cudaHostAlloc (page-locking, slower than the
  copy into it) for any size it has no free block of; kept buffers make the reuse certain and
  countable (`host_allocations`). The way back always allocates fresh device tensors, never
  handing a host buffer to a holder, so nothing on the device aliases a buffer the next
  offload overwrites.

A tensor reached twice (tied embeddings, a shared buffer) moves once and is counted once.

The books (`Move`, `resident`, `resident_bytes`): on the CPU there is nowhere to move to, so
the calls copy nothing (`copies` False; the tests set it to make the CPU copy into fresh
storage) but keep the same books as on a GPU: the bytes a move carries, the gradient bytes
it dropped, whether the state is resident. Colocation (weights/colocate.py) records them at
every turn and checks its invariant with them, so the turns' order is observable on the CPU
too; the GPU tests compare them with `torch.cuda.memory_allocated`. Every move is timed and
logged, so a colocated run shows what offloading costs per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

# A holder and the attribute or key its tensor is under: (param, "data"), (module._buffers,
# name), (an optimizer's per-parameter state dict, "exp_avg").
Slot = tuple[Any, str]


@dataclass
class Move:
    """One offload or onload: the bytes it moved (or would, on the CPU), the gradient bytes
    it dropped instead of moving (an offload's), and its seconds."""

    nbytes: int = 0
    seconds: float = 0.0
    dropped: int = 0


class TrainOffload:
    """Moves a torch backend's GPU state to host memory and back (module docstring)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.device = torch.device(backend.device)
        self.resident = True
        self.moves = 0  # offloads + onloads done
        self.last = Move()
        # Whether a move copies: not on the CPU (the tests set it to move CPU tensors into
        # fresh ones, which is how they check that every holder follows its tensor).
        self.copies = self.device.type != "cpu"
        # Each slot's host buffer, kept across offloads (module docstring), with its holder so
        # the id in the key cannot be reused by another object while the entry lives.
        self._host: dict[tuple[int, str], tuple[Any, torch.Tensor]] = {}
        self.host_allocations = 0  # host buffers allocated so far (the tests read it)

    def _models(self) -> Iterator[torch.nn.Module]:
        b = self.backend
        for model in (b.model, b.ref, b.teacher, b.critic):
            if model is not None:
                yield model

    def _params(self) -> Iterator[torch.nn.Parameter]:
        """Every parameter that holds state: each model's, and the --bf16 masters."""
        for model in self._models():
            yield from model.parameters()
        if self.backend.master is not None:
            yield from self.backend.master.params

    def _slots(self) -> Iterator[tuple[Any, str, torch.Tensor]]:
        """(holder, attribute or key, tensor) for every tensor that moves."""
        b = self.backend
        for param in self._params():
            yield param, "data", param.data
        for model in self._models():
            for module in model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    yield module._buffers, name, buf
        for optimizer in (b.optimizer, getattr(b, "critic_optimizer", None)):
            if optimizer is None:
                continue
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        yield state, key, value

    def _distinct(self) -> Iterator[tuple[list[Slot], torch.Tensor]]:
        """Each distinct tensor once, with every slot that holds it (a tie: several)."""
        slots: dict[tuple[Any, ...], tuple[list[Slot], torch.Tensor]] = {}
        for holder, key, tensor in self._slots():
            same = (
                tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                tensor.dtype, tuple(tensor.shape), tensor.stride(),
            )  # fmt: skip
            slots.setdefault(same, ([], tensor))[0].append((holder, key))
        yield from slots.values()

    def nbytes(self) -> int:
        """The bytes a move carries: every distinct tensor of `_slots`, gradients not."""
        return sum(t.nbytes for _, t in self._distinct())

    def grad_bytes(self) -> int:
        """The bytes of the gradients held now (an offload drops them)."""
        return sum(p.grad.nbytes for p in self._params() if p.grad is not None)

    def resident_bytes(self) -> int:
        """The trainer's state on its device, by the books: everything a move carries and
        the gradients while resident, nothing once offloaded."""
        return self.nbytes() + self.grad_bytes() if self.resident else 0

    def to_host(self) -> Move:
        """Everything to host memory, the gradients dropped (module docstring); a no-op when
        already there."""
        if not self.resident:
            return Move()
        start = time.perf_counter()
        dropped = self._drop_grads()
        move = self._move(to_host=True, start=start, dropped=dropped)
        self.resident = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info(
            "offloaded the trainer: %.1f MiB in %.3f s (%.1f MiB of gradients dropped)",
            move.nbytes / 2**20, move.seconds, move.dropped / 2**20,
        )  # fmt: skip
        return move

    def to_device(self) -> Move:
        """Everything back on the trainer's device; a no-op when it is there."""
        if self.resident:
            return Move()
        move = self._move(to_host=False, start=time.perf_counter())
        self.resident = True
        log.info("onloaded the trainer: %.1f MiB in %.3f s", move.nbytes / 2**20, move.seconds)
        return move

    def _drop_grads(self) -> int:
        """Let go of every gradient (dead after the step: module docstring); their bytes."""
        dropped = 0
        for param in self._params():
            if param.grad is not None:
                dropped += param.grad.nbytes
                param.grad = None
        return dropped

    def _move(self, *, to_host: bool, start: float, dropped: int = 0) -> Move:
        nbytes = 0
        host: dict[tuple[int, str], tuple[Any, torch.Tensor]] = {}
        for slots, tensor in list(self._distinct()):
            nbytes += tensor.nbytes
            if not self.copies:
                continue
            if to_host:
                moved = self._host_buffer(slots[0], tensor, host)
            else:  # fresh, never a host buffer: the next offload writes into those
                moved = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            moved.copy_(tensor, non_blocking=True)
            for holder, key in slots:
                if isinstance(holder, dict):
                    holder[key] = moved
                else:
                    setattr(holder, key, moved)
        if to_host and self.copies:
            self._host = host  # slots gone since the last offload let their buffers go
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.moves += 1
        self.last = Move(nbytes, time.perf_counter() - start, dropped)
        return self.last

    def _host_buffer(
        self,
        slot: Slot,
        tensor: torch.Tensor,
        kept: dict[tuple[int, str], tuple[Any, torch.Tensor]],
    ) -> torch.Tensor:
        """The slot's host buffer from the last offload, or a new one where there is none of
        this shape and dtype; recorded in `kept` for the next offload."""
        key = (id(slot[0]), slot[1])
        entry = self._host.get(key)
        buffer = entry[1] if entry is not None else None
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(
                tensor.shape, dtype=tensor.dtype, device="cpu",
                pin_memory=self.device.type == "cuda",
            )  # fmt: skip
            self.host_allocations += 1
        kept[key] = (slot[0], buffer)
        return buffer
