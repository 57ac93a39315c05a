"""--offload-train: the trainer's GPU state goes to host memory while colocated engines generate.

    offload = TrainOffload(backend)
    offload.to_host()            between steps: every model's parameters (actor, reference,
                                 teacher, critic), the --bf16 fp32 masters, their gradients
                                 and every optimizer's state, to (pinned) host memory; the
                                 GPU's cache handed back to the driver for the engine
    offload.to_device()          before the next step: all of it back, the same tensors

Parameters keep their identity (their `.data` is swapped, as `Module.to` does), so the
optimizers, the --bf16 gradient hooks and the weight sync's views all still hold them. An
optimizer's state tensors move only when they live on the device (Adam's `step` counters stay
on the host, where torch's non-capturable Adam wants them).

On the CPU there is nowhere to move to: the calls do no copies and only keep the books (what
is resident, the bytes that would move), which is what the CPU tests check. Every move is
timed and logged, so a colocated run shows what offloading costs per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class Move:
    """One offload or onload: the bytes it moved (or would, on the CPU) and its seconds."""

    nbytes: int = 0
    seconds: float = 0.0


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

    def _tensors(self) -> Iterator[tuple[Any, str, torch.Tensor]]:
        """(holder, attribute or key, tensor) for every tensor that moves."""
        b = self.backend
        for model in (b.model, b.ref, b.teacher, b.critic):
            if model is None:
                continue
            for param in model.parameters():
                yield param, "data", param.data
                if param.grad is not None:
                    yield param, "grad", param.grad
            for module in model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    yield module._buffers, name, buf
        if b.master is not None:
            for param in b.master.params:
                yield param, "data", param.data
                if param.grad is not None:
                    yield param, "grad", param.grad
        for optimizer in (b.optimizer, getattr(b, "critic_optimizer", None)):
            if optimizer is None:
                continue
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        yield state, key, value

    def nbytes(self) -> int:
        return sum(t.nbytes for _, _, t in self._tensors())

    def to_host(self) -> Move:
        """Everything to host memory (module docstring); a no-op when already there."""
        if not self.resident:
            return Move()
        move = self._move(torch.device("cpu"))
        self.resident = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("offloaded the trainer: %.1f MiB in %.3f s", move.nbytes / 2**20, move.seconds)
        return move

    def to_device(self) -> Move:
        """Everything back on the trainer's device; a no-op when it is there."""
        if self.resident:
            return Move()
        move = self._move(self.device)
        self.resident = True
        log.info("onloaded the trainer: %.1f MiB in %.3f s", move.nbytes / 2**20, move.seconds)
        return move

    def _move(self, target: torch.device) -> Move:
        start = time.perf_counter()
        nbytes = 0
        pin = target.type == "cpu" and self.device.type == "cuda"
        # A tensor can be reached twice (tied embeddings): move each storage once.
        done: dict[int, torch.Tensor] = {}
        for holder, key, tensor in list(self._tensors()):
            nbytes += tensor.nbytes
            if not self.copies:
                continue
            moved = done.get(id(tensor))
            if moved is None:
                moved = torch.empty(
                    tensor.shape, dtype=tensor.dtype, device=target, pin_memory=pin
                ).copy_(tensor, non_blocking=True)
                done[id(tensor)] = moved
            if isinstance(holder, dict):
                holder[key] = moved
            else:
                setattr(holder, key, moved)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.moves += 1
        self.last = Move(nbytes, time.perf_counter() - start)
        return self.last
