"""The decode step captured in CUDA graphs, one per (batch size, context bucket).

A captured step has fixed shapes, so its attention is one group (paged_attention.py) of B
rows over L key columns: B the smallest captured batch size >= the running rows (1, 2, 4, 8,
then every 8 up to --cuda-graph-max-bs), L the smallest context bucket >= the longest row
(256, 512, ... doubling, then the context length). The step reads B x L keys: what the live
rows need, rounded up, never the pool's size. Its inputs are static buffers that each replay
fills:
    input_ids_1B, position_ids_1B     each row's last token and its position,
    write_slots_B                     the slot each row's new key goes to,
    slots_BL                          each row's first L table entries (the null slot past
                                      its length),
    lengths_B                         each row's context length, from which the mask
                                      [B, 1, 1, L] is computed on the device,
and spare rows (B - n) decode a dummy token into the null slot, attending to it alone (a
finite key, never read by a real row: the null slot is masked wherever it pads).

Graphs are captured on first use, into one shared memory pool; at start-up (and after a
resume) every batch size is captured for the first bucket, where short rollouts decode.
They hold the weights' and the pool's addresses: a weight update copies in place (they stay
valid); releasing memory drops them, and they are captured again once the engine can step.
Every capture logs its time.

On a CPU (the engine turns graphs on only on CUDA; tests build them on the CPU) a "graph"
is `_EagerReplay`: each replay runs the same forward over the same static buffers into the
same logits tensor. So all of the above but the capture itself (bucketing, spare rows, the
static inputs, dropping and capturing again) runs, and is tested, where no GPU is.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..kv.token_pool import NULL_SLOT, TokenPool
from .paged_attention import AttnGroup, StepPlan, planned

log = logging.getLogger(__name__)

FIRST_BUCKET = 256


def graph_sizes(max_bs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 8, up to and including `max_bs`."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


def context_buckets(context: int) -> list[int]:
    """Key widths captured: 256, 512, ... doubling while below `context`, then `context`."""
    buckets, width = [], FIRST_BUCKET
    while width < context:
        buckets.append(width)
        width *= 2
    return [*buckets, context]


class _Inputs:
    def __init__(self, rows: int, width: int, device: Any):
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids_1B = zeros(1, rows)
        self.position_ids_1B = zeros(1, rows)
        self.write_slots_B = zeros(rows)
        self.slots_BL = zeros(rows, width)
        self.lengths_B = torch.ones(rows, dtype=torch.long, device=device)
        self.columns_L = torch.arange(width, device=device)
        self.mask_B11L = zeros(rows, 1, 1, width, dtype=torch.bool)

    def fill_mask(self) -> None:
        torch.lt(self.columns_L[None, :], self.lengths_B[:, None], out=self.mask_B11L[:, 0, 0])


def _forward(model: Any, pool: TokenPool, x: _Inputs) -> torch.Tensor:
    rows, width = x.slots_BL.shape
    group = AttnGroup(
        rows,
        1,
        width,
        torch.arange(rows, device=x.slots_BL.device),
        x.slots_BL.view(-1),
        x.mask_B11L,
    )
    plan = StepPlan(pool.keys, pool.values, x.write_slots_B, [group], direct=True)
    x.fill_mask()
    with planned(plan) as mask:
        out = model(
            input_ids=x.input_ids_1B,
            position_ids=x.position_ids_1B,
            attention_mask=mask,
            use_cache=False,
        )
    return out.logits[0]


class _EagerReplay:
    """A CPU stand-in for a captured graph: `replay` computes the step again from the static
    inputs into the output it first returned, as a graph's replay does."""

    def __init__(self, model: Any, pool: TokenPool, x: _Inputs):
        self._run = lambda: _forward(model, pool, x)
        self.logits_BV = self._run()

    def replay(self) -> None:
        self.logits_BV.copy_(self._run())


class DecodeGraphs:
    def __init__(self, model: Any, pool: TokenPool, *, max_bs: int, context: int):
        self.model, self.pool = model, pool
        self.sizes = graph_sizes(max_bs)
        self.buckets = context_buckets(context)
        self._graphs: dict[tuple[int, int], tuple[Any, _Inputs, torch.Tensor]] = {}
        self._memory: Any = None

    def size_for(self, rows: int, longest: int) -> tuple[int, int] | None:
        """The captured (batch size, bucket) a step of `rows` rows runs as (None: none)."""
        size = next((b for b in self.sizes if b >= rows), None)
        bucket = next((w for w in self.buckets if w >= longest), None)
        return None if size is None or bucket is None else (size, bucket)

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(self._graphs)

    def capture_all(self) -> None:
        """Capture every batch size for the first bucket, largest first (the smaller reuse
        its memory). Writes the null slot only: safe with rows in the pool."""
        start = time.perf_counter()
        with torch.inference_mode():
            for rows in sorted(self.sizes, reverse=True):
                key = (rows, self.buckets[0])
                if key not in self._graphs:
                    self._graphs[key] = self._capture(*key)
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)
        log.info(
            # Not "captured the decode step ...": bench_gpu.py counts those lines, one a graph.
            "CUDA graphs of the decode step for batch sizes %s (keys up to %d) ready in %.2f s",
            self.sizes,
            self.buckets[0],
            time.perf_counter() - start,
        )

    def clear(self) -> None:
        self._graphs.clear()
        self._memory = None

    def step(
        self,
        key: tuple[int, int],
        n: int,
        ids_B: torch.Tensor,
        positions_B: torch.Tensor,
        new_slots_B: torch.Tensor,
        table_RL: torch.Tensor,
    ) -> torch.Tensor:
        """Replay graph `key` for n live rows (capturing it first): their last tokens, the
        positions of those tokens and their new slots, on the device; returns its logits."""
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        graph, x, logits_BV = self._graphs[key]
        width = key[1]
        x.input_ids_1B[0, :n].copy_(ids_B)
        x.input_ids_1B[0, n:].zero_()
        x.position_ids_1B[0, :n].copy_(positions_B)
        x.position_ids_1B[0, n:].zero_()
        torch.add(positions_B, 1, out=x.lengths_B[:n])  # each context with its new token
        x.lengths_B[n:].fill_(1)
        x.write_slots_B[:n].copy_(new_slots_B)
        x.write_slots_B[n:].fill_(NULL_SLOT)
        x.slots_BL[:n].copy_(table_RL[:n, :width])
        x.slots_BL[n:].fill_(NULL_SLOT)
        graph.replay()
        return logits_BV

    def _capture(self, rows: int, width: int) -> tuple[Any, _Inputs, torch.Tensor]:
        start = time.perf_counter()
        device = self.pool.device
        x = _Inputs(rows, width, device)  # every row a spare: writes the null slot only
        if device.type != "cuda":
            eager = _EagerReplay(self.model, self.pool, x)
            return eager, x, eager.logits_BV
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up off the capture (cuBLAS workspaces)
            for _ in range(2):
                _forward(self.model, self.pool, x)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._memory):
            logits_BV = _forward(self.model, self.pool, x)
        log.info(
            "captured the decode step for batch size %d over %d keys in a CUDA graph (%.3f s)",
            rows,
            width,
            time.perf_counter() - start,
        )
        return graph, x, logits_BV
