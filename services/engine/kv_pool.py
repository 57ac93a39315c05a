"""The static KV cache (`--kv-cache static`, the default on a GPU): one preallocated pool that
every row decodes into, and the decode step captured in CUDA graphs.

Layout. Per layer, `keys`/`values` of shape [S, H, W, D]: S slots (one per running row,
--max-running-requests), W columns. Rows sit in slots 0..n-1 in `seqs` order. As in the
dynamic cache (kv_batch.py) a row's tokens are right-aligned: every live row's last token is
in column `end - 1`, so one decode step writes every row's new key into the same column
`end`. That single column is what makes the step static: its inputs are
    input_ids_B1, position_ids_B1     each row's last token and true position,
    column                            a one-element tensor holding `end`,
    mask_B11W                         0 where a row has a key, the dtype's minimum elsewhere,
all of fixed shape for a batch size B, so the step can be captured once per B and replayed.
A batch of n rows runs as the smallest captured B >= n; the B - n spare slots decode a dummy
token that attends only to its own new column (finite, never read).

Join: newcomers are prefilled in a dynamic cache (model_runner.prefill) and copied into the
next free slots at columns [end - w, end); a prefix longer than `end` first shifts the live
rows right. Leave: survivors are gathered into slots 0..k-1. When `end` reaches W, the
columns left of the longest live row (padding for every row) are dropped by shifting left;
--context-length is capped at W, so a live row always fits.

Masked columns may hold an earlier row's keys: they get the dtype's minimum before the
softmax, so weight 0, and they are finite (the pool starts zeroed, and only real keys or a
dummy row's own key are ever written), so 0 x value adds nothing.

CUDA graphs (`DecodeGraphs`): for each B of 1, 2, 4, 8 and then every 8 up to
--cuda-graph-max-bs, the decode forward is captured on first use into one shared memory pool,
over static input buffers; a replay copies the inputs in and returns the static logits. The
graphs hold the weights' and the pool's addresses: a weight update copies in place (they
stay valid); releasing memory (control_api's /release_memory_occupation) drops them, since
the weights and the pool come back at new addresses (model_runner.py), and they are captured
again once the engine can step: all at once when no row runs (`warm_graphs`, after a
colocated sync: the rows were retracted), else each size on first use. Every capture logs
its time. Where capture is not possible (the CPU, or --disable-cuda-graph) the same code runs
eagerly, over the live columns only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .model_runner import cache_kwarg
from .sequence import Sequence

log = logging.getLogger(__name__)


def graph_sizes(max_bs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 8, up to and including `max_bs`."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


class _PoolLayer(CacheLayerMixin):
    """One layer of the pool as a transformers cache layer: writes the step's keys at
    `column`, returns the first `span` columns (all W when captured, the live ones eagerly)."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor, span: int):
        super().__init__()
        self.keys, self.values, self.column, self.span = keys, values, column, span
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the pool is allocated up front

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys[:, :, : self.span], self.values[:, :, : self.span]

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.span, 0

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.span

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class KVPool:
    """The preallocated keys and values of every layer, [S, H, W, D] each."""

    def __init__(self, config: Any, slots: int, width: int, dtype: torch.dtype, device: Any):
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.slots, self.width = slots, width
        self.shape = (slots, heads, width, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.layers = config.num_hidden_layers
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes_allocated = 2 * self.layers * slots * heads * width * head_dim * itemsize
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.allocate()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def allocate(self) -> None:
        self.keys = [torch.zeros(self.shape, dtype=self.dtype, device=self.device)]
        self.keys += [torch.zeros_like(self.keys[0]) for _ in range(self.layers - 1)]
        self.values = [torch.zeros_like(self.keys[0]) for _ in range(self.layers)]

    def free(self) -> None:
        self.keys, self.values = [], []

    def zero_(self) -> None:
        for t in self.keys + self.values:
            t.zero_()

    def cache(self, rows: int, column: torch.Tensor, span: int) -> Cache:
        """Rows 0..rows-1 of every layer as a transformers Cache (views: writes land in the pool)."""
        return Cache(
            layers=[
                _PoolLayer(k[:rows], v[:rows], column, span)
                for k, v in zip(self.keys, self.values, strict=True)
            ]
        )


class _StepInputs:
    """The decode step's inputs for a batch of B rows; static buffers when captured."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: Any):
        self.input_ids_B1 = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.position_ids_B1 = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask_B11W = torch.zeros(rows, 1, 1, width, dtype=dtype, device=device)


def _forward(
    model: Any, pool: KVPool, x: _StepInputs, column: torch.Tensor, span: int
) -> torch.Tensor:
    rows = x.input_ids_B1.shape[0]
    out = model(
        input_ids=x.input_ids_B1,
        # A mapping of ready masks: transformers then builds none (no host sync, capturable).
        attention_mask={"full_attention": x.mask_B11W[..., :span]},
        position_ids=x.position_ids_B1,
        use_cache=True,
        **{cache_kwarg(model): pool.cache(rows, column, span)},
    )
    return out.logits[:, -1, :]


class DecodeGraphs:
    """Decode steps captured per batch size (module docstring); `None` step: run eagerly."""

    def __init__(self, model: Any, pool: KVPool, column: torch.Tensor, max_bs: int):
        self.model, self.pool, self.column = model, pool, column
        self.sizes = graph_sizes(min(max_bs, pool.slots))
        self._graphs: dict[int, tuple[Any, _StepInputs, torch.Tensor]] = {}
        self._memory: Any = None

    def size_for(self, rows: int) -> int | None:
        """The captured batch size a batch of `rows` runs as (None: larger than any)."""
        return next((b for b in self.sizes if b >= rows), None)

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def capture_all(self) -> None:
        """Capture every size now, largest first (the smaller reuse its memory): at start-up
        and after a resume, so the first requests do not wait for captures. Zeroes the pool:
        call it with no row in it."""
        start = time.perf_counter()
        with torch.inference_mode():  # as the scheduler thread runs them
            for rows in sorted(self.sizes, reverse=True):
                if rows not in self._graphs:
                    self._graphs[rows] = self._capture(rows)
            self.pool.zero_()
        torch.cuda.synchronize(self.pool.device)
        log.info(
            # Not "captured the decode step ...": bench_gpu.py counts those lines, one a size.
            "CUDA graphs of the decode step for batch sizes %s ready in %.2f s",
            self.sizes,
            time.perf_counter() - start,
        )

    def clear(self) -> None:
        """Forget every graph (the weights or the pool moved; captured again on next use)."""
        self._graphs.clear()
        self._memory = None

    def step(self, rows: int, fill: Callable[[_StepInputs], None]) -> torch.Tensor:
        """Replay the graph of `rows` rows (capturing it first) after `fill` set its inputs."""
        if rows not in self._graphs:
            self._graphs[rows] = self._capture(rows)
        graph, inputs, logits_BV = self._graphs[rows]
        fill(inputs)
        graph.replay()
        return logits_BV

    def _capture(self, rows: int) -> tuple[Any, _StepInputs, torch.Tensor]:
        start = time.perf_counter()
        pool, width = self.pool, self.pool.width
        inputs = _StepInputs(rows, width, pool.dtype, pool.device)
        # Warm up on a side stream (cuBLAS workspaces, lazy inits), as torch.cuda.graphs says.
        # Warm-up and capture write keys into column `end` of rows 0..rows-1: the step that
        # follows writes the live rows' own keys there, and the rest are spare slots.
        stream = torch.cuda.Stream(device=pool.device)
        stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                _forward(self.model, pool, inputs, self.column, width)
        torch.cuda.current_stream(pool.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._memory):
            logits_BV = _forward(self.model, pool, inputs, self.column, width)
        log.info(
            "captured the decode step for batch size %d in a CUDA graph (%.3f s)",
            rows,
            time.perf_counter() - start,
        )
        return graph, inputs, logits_BV


class PoolBatch:
    """The running batch over a KVPool; the same interface as kv_batch.RunningBatch."""

    def __init__(
        self,
        model: Any,
        pool: KVPool,
        *,
        cuda_graph_max_bs: int | None = None,
    ):
        self.model, self.pool = model, pool
        self.seqs: list[Sequence] = []
        self.end = 0
        self.live_SW = torch.zeros(pool.slots, pool.width, dtype=torch.bool, device=pool.device)
        self.column = torch.zeros(1, dtype=torch.long, device=pool.device)
        self.graphs = (
            DecodeGraphs(model, pool, self.column, cuda_graph_max_bs)
            if cuda_graph_max_bs and pool.device.type == "cuda"
            else None
        )

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        """Columns in use (the dynamic cache's width)."""
        return self.end

    def clear(self) -> None:
        self.seqs, self.end = [], 0
        self.live_SW.zero_()

    def release(self) -> int:
        """Free the pool (its rows were retracted); returns the bytes freed."""
        nbytes = self.pool.nbytes
        self.clear()
        self.forget_graphs()
        self.pool.free()
        return nbytes

    def resume(self) -> int:
        """Allocate the pool again (zeroed); returns its bytes."""
        self.pool.allocate()
        return self.pool.nbytes

    def forget_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()

    def warm_graphs(self) -> None:
        """Capture every graph size again now, if they were forgotten and no row runs (the
        capture zeroes the pool); with rows running, each size is captured on first use."""
        if self.graphs is not None and not self.graphs.captured and not self.seqs:
            self.graphs.capture_all()

    def add(self, seqs: list[Sequence], cache: Any, mask_BT: torch.Tensor) -> None:
        """Copy prefilled rows (their dynamic cache, `mask_BT` marking real columns) into the
        next free slots, right-aligned at `end`."""
        if not seqs:
            return
        n, k, w = len(self.seqs), len(seqs), mask_BT.shape[1]
        assert n + k <= self.pool.slots, f"{n + k} rows for {self.pool.slots} slots"
        assert w < self.pool.width, f"a prefix of {w} tokens in a pool of {self.pool.width}"
        if w > self.end:
            self._shift(w - self.end)
        lo, hi = self.end - w, self.end
        for layer, keys, values in zip(cache.layers, self.pool.keys, self.pool.values, strict=True):
            keys[n : n + k, :, lo:hi] = layer.keys
            values[n : n + k, :, lo:hi] = layer.values
        self.live_SW[n : n + k] = False
        self.live_SW[n : n + k, lo:hi] = mask_BT.bool()
        self.seqs.extend(seqs)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order), gathered into slots 0..len(rows)-1."""
        if rows == list(range(len(self.seqs))):
            return
        if not rows:
            self.clear()
            return
        k, end = len(rows), self.end
        index_K = torch.tensor(rows, device=self.pool.device)
        for t in self.pool.keys + self.pool.values:
            t[:k, :, :end] = t[index_K, :, :end]
        self.live_SW[:k] = self.live_SW[index_K]
        self.live_SW[k:] = False
        self.seqs = [self.seqs[i] for i in rows]

    def _shift(self, by: int) -> None:
        """Move the live rows' columns [0, end) by `by` (right if > 0, left if < 0)."""
        n, end = len(self.seqs), self.end
        src, dst = (
            (slice(0, end), slice(by, end + by))
            if by > 0
            else (slice(-by, end), slice(0, end + by))
        )
        for t in self.pool.keys + self.pool.values:
            t[:n, :, dst] = t[:n, :, src].clone()
        self.live_SW[:n, dst] = self.live_SW[:n, src].clone()
        if by > 0:
            self.live_SW[:n, :by] = False
        else:
            self.live_SW[:n, end + by : end] = False
        self.end = end + by

    def _compact(self) -> None:
        """Drop the columns that are padding for every live row (`end` reached the pool's W)."""
        n = len(self.seqs)
        live_W = self.live_SW[:n, : self.end].any(dim=0)
        first = int(live_W.nonzero()[0]) if bool(live_W.any()) else self.end
        assert first > 0, "a live row fills the whole pool (--context-length is capped at it)"
        self._shift(-first)

    @torch.inference_mode()
    def decode(self, model: Any) -> torch.Tensor:
        """One decode step over every row; returns next-token logits_BV."""
        n = len(self.seqs)
        if self.end >= self.pool.width:
            self._compact()
        col = self.end
        self.live_SW[:n, col] = True
        size = self.graphs.size_for(n) if self.graphs is not None else None
        rows = size or n
        self.live_SW[n:rows, col] = True  # spare rows attend to their own dummy key only
        self.column.fill_(col)

        def fill(x: _StepInputs) -> None:
            ids = [s.output_ids[-1] for s in self.seqs] + [0] * (rows - n)
            positions = [s.next_position for s in self.seqs] + [0] * (rows - n)
            x.input_ids_B1.copy_(torch.tensor(ids)[:, None], non_blocking=True)
            x.position_ids_B1.copy_(torch.tensor(positions)[:, None], non_blocking=True)
            span = x.mask_B11W.shape[-1]
            live_BW = self.live_SW[:rows, :span]
            x.mask_B11W.copy_(
                torch.zeros_like(x.mask_B11W).masked_fill_(
                    ~live_BW[:, None, None, :], torch.finfo(x.mask_B11W.dtype).min
                )
            )

        if size is not None:
            assert self.graphs is not None
            logits_BV = self.graphs.step(size, fill)
        else:
            inputs = _StepInputs(rows, col + 1, self.pool.dtype, self.pool.device)
            fill(inputs)
            logits_BV = _forward(model, self.pool, inputs, self.column, col + 1)
        self.live_SW[n:rows] = False
        self.end = col + 1
        return logits_BV[:n]
