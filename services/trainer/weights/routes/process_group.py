"""Rank 0 of a weight update group (the nccl route: nccl.py): the trainer's end of
`/init_weights_update_group`.

The engines join with SGLang's (and Miles') `init_custom_process_group` rendezvous; this is
the same rendezvous seen from rank 0, which hosts it:
    store = TCPStore(master_address, port 0 -> a free port, is_master=True);
    torch's `_new_process_group_helper(world_size, 0, [], backend, PrefixStore(name, store))`.
Binding port 0 and reading the bound port back avoids the race of "find a free port, close
it, hope nobody takes it". The group is stateless with respect to torch's default group: no
`init_process_group` is needed, so a trainer under torchrun and a bare process work alike
(caveat: if the default group is NCCL bound to a device, `init_process_group(device_id=...)`,
torch's helper splits from it instead; leave the trainer's default group unbound).

gloo on CPU and nccl on GPU from the same code: the backend picks the device tensors are
broadcast from. Every blocking call (join, broadcast) is bounded by the group's timeout,
so a peer that never shows up yields an exception, never a hang. Blocking methods: call them
from a worker thread, never from the event loop.

What is broadcast: a bucket (base.py) as one broadcast per tensor, or with load_format
"flattened_bucket" (SGLang's, the default of --weight-sync-format) as ONE broadcast of its
tensors' bytes back to back: for a small model the per-tensor round trips were most of the
broadcast (bench_weight_sync.py).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from .base import flatten_bytes

log = logging.getLogger("millstream.trainer")

BACKENDS = ("gloo", "nccl")


def backend_for(device: torch.device) -> str:
    """The collective backend for tensors living on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


class UpdateGroup:
    """One named process group in which this process is rank 0 and broadcasts weights."""

    def __init__(
        self, name: str, world_size: int, backend: str, master_address: str, timeout_s: float
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend: nccl needs CUDA and this trainer has none; use gloo")
        self.name = name
        self.world_size = world_size
        self.backend = backend
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        self.timeout = timedelta(seconds=timeout_s)
        self._store = torch.distributed.TCPStore(
            master_address,
            0,
            is_master=True,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        self.port: int = self._store.port
        self._pg: Any = None

    @property
    def joined(self) -> bool:
        return self._pg is not None

    def join(self) -> None:
        """Blocks until every engine rank has joined, or raises after the timeout."""
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            _world,
        )

        # The helper's options keyword was renamed across torch versions.
        params = inspect.signature(_new_process_group_helper).parameters
        options = "backend_options" if "backend_options" in params else "pg_options"
        pg, _ = _new_process_group_helper(
            self.world_size,
            0,
            [],
            Backend(self.backend),
            PrefixStore(self.name, self._store),
            group_name=self.name,
            timeout=self.timeout,
            **{options: None},
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}
        self._pg = pg
        log.info(
            "weight update group %r: rank 0 of %d (%s)", self.name, self.world_size, self.backend
        )

    def broadcast(self, tensors: Sequence[torch.Tensor], flattened: bool = False) -> None:
        """Broadcast each tensor from rank 0, in order, or (`flattened`) all their bytes back
        to back in one broadcast; raises on a timeout or a lost peer."""
        if self._pg is None:
            raise RuntimeError(f"weight update group {self.name!r}: join() first")
        if flattened:
            tensors = [flatten_bytes([self.on_device(t) for t in tensors])]
        for tensor in tensors:
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank = 0
            self._pg.broadcast([self.on_device(tensor)], opts).wait(self.timeout)
        if self.device.type == "cuda":
            # NCCL's wait() only orders streams; the tensors must be sent before we return.
            torch.cuda.current_stream(self.device).synchronize()

    def on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to(self.device).contiguous()

    def destroy(self) -> None:
        """Leave the group (if joined) and stop hosting its store. Idempotent."""
        pg, self._pg = self._pg, None
        if pg is not None:
            torch.distributed.destroy_process_group(pg)
        self._store = None
