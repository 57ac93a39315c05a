"""The token pool's memory (engine/kv/token_pool.py): its host books cost what the slots a call
names do, never the pool's size (a tiny model's pool on a 141 GB GPU is ~300M tokens, and a
colocated run allocates it again at every resume); pages are handed out in a fixed order;
and a released pool leaves no tensor of it reachable, so its memory really goes back."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.kv.token_pool import PAGE, TokenPool
from millstream.engine.paged_batch import PagedBatch
from millstream.engine.scheduler import Scheduler
from tests.unit.engine.test_engine_scheduler import PROMPTS, Tracked

pytestmark = pytest.mark.timeout(120)

HUGE = 2**26  # tokens: 2**22 pages, what a GPU's pool is to within a few doublings
FEW = 2048  # elements: anything that walks the pool's pages is thousands of times more


class HostWork(TorchDispatchMode):
    """Counts the elements that host (CPU) tensor ops write: each new tensor's, an in-place
    op's target's, an indexed write's (index_add_, index_put_) indices and values. Views
    write nothing, nor does torch.empty (the host maps its pages as they are first
    written); tensors on another device (the pool's KV on `meta` here) are not the host's."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func.overloadpacket is torch.ops.aten.empty:
            return out
        schema = func._schema.arguments
        written = [a.name for a in schema if a.alias_info is not None and a.alias_info.is_write]
        given = {a.name: v for a, v in zip(schema, args, strict=False)} | kwargs
        if not written:
            counted = [out]
        elif {"index", "indices"} & given.keys():
            counted = [v for name, v in given.items() if name not in written]
        else:
            counted = [given[name] for name in written]
        self.elements += sum(
            t.numel()
            for t in torch.utils._pytree.tree_leaves(counted)
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"
        )
        return out


def counted(call: Any) -> tuple[Any, int]:
    with HostWork() as work:
        result = call()
    return result, work.elements


def test_drop_allocate_and_resume_cost_the_slots_not_the_pools_size():
    """A pool of 2**26 tokens whose KV lives on `meta` (no memory): making it, dropping a
    few rows' slots, allocating after a drop, and a release and resume each write fewer than
    FEW host elements, where books over the pool's slots (a per-token count, an arange of
    every page, the free list concatenated at each drop) write millions."""
    config = SimpleNamespace(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64
    )
    pool, made = counted(lambda: TokenPool(config, HUGE, torch.float32, "meta"))
    assert pool.capacity == pool.free_tokens == HUGE and made < FEW
    rows = [pool.alloc(40 + i) for i in range(8)]
    pool.hold(rows[2])  # a second copy of row 2
    freed, work = counted(lambda: pool.drop(torch.cat(rows[:3])))
    assert freed == 2 * 3 * PAGE and work < FEW  # row 2's pages still held once
    again, work = counted(lambda: pool.alloc(8 * PAGE))
    assert work < FEW
    assert (again[::PAGE] // PAGE).tolist() == [1, 2, 3, 4, 5, 6, 25, 26]  # returned first
    assert pool.used_tokens == (3 * 6 + 8) * PAGE
    nbytes, work = counted(pool.free_memory)
    assert nbytes == pool.bytes_per_token * (HUGE + PAGE) and work < FEW
    nbytes, work = counted(pool.allocate)
    assert pool.free_tokens == HUGE and work < FEW
    assert pool.alloc(1).tolist() == [PAGE]  # page 1 again: a resumed pool starts over


def test_pages_go_out_returned_last_first_then_fresh_in_order_and_through_growth(
    runner: ModelRunner,
):
    """The order pages are handed out in: the pages a drop returned, the lowest first and
    the last drop's before the earlier ones', then pages never handed out, ascending, the
    grown ones after the others; a slot dropped more than held is an error."""
    pool = TokenPool(runner.model.config, 8 * PAGE, runner.dtype, "cpu", limit=16 * PAGE)
    a, b, c = pool.alloc(16), pool.alloc(40), pool.alloc(5)  # pages 1; 2, 3, 4; 5

    def pages(slots: torch.Tensor) -> list[int]:
        return sorted(set((slots // PAGE).tolist()))

    assert (pages(a), pages(b), pages(c)) == ([1], [2, 3, 4], [5])
    assert pool.drop(b[16:32]) == PAGE  # page 3: none of its slots is held now
    assert pool.drop(torch.cat([c, a])) == 2 * PAGE  # pages 1 and 5
    assert (pool.take_pages(4) // PAGE).tolist() == [1, 5, 3, 6]
    assert pool.free_tokens == 2 * PAGE and pool.capacity == 8 * PAGE
    assert (pool.take_pages(3) // PAGE).tolist() == [7, 8, 9]  # grown for the last
    assert pool.capacity == 16 * PAGE and pool.free_tokens == 7 * PAGE
    with pytest.raises(AssertionError, match="dropped more than held"):
        pool.drop(a)


@pytest.mark.parametrize("graphs", [None, 8], ids=["eager", "graphs"])
def test_after_a_release_no_tensor_of_the_pool_is_reachable(
    runner: ModelRunner, graphs: int | None
):
    """Rows prefilled and decoding (eagerly, and on the CPU's graph path: decode_graphs.py)
    when the KV cache is released: afterwards every key and value tensor the pool had is
    garbage, so on a GPU its memory is free for the colocated trainer (a step's plan kept
    for stats, a graph's static inputs or the attention's thread-local plan would hold them
    all). The rows then run to the end on the resumed pool."""
    pool = TokenPool(runner.model.config, 4096, runner.dtype, runner.device)
    batch = PagedBatch(
        runner.model, pool, max_rows=8, context_length=1024, cuda_graph_max_bs=graphs
    )
    if batch.graphs is not None:
        batch.graphs.capture_all()
    sched = Scheduler(runner, batch)
    sched.start()
    try:
        tracked = [
            Tracked(f"r{i}", p, max_new_tokens=60, ignore_eos=True) for i, p in enumerate(PROMPTS)
        ]
        sched.submit([t.seq for t in tracked])
        tracked[0].wait_tokens(5)
        kv = sched.call(lambda: [weakref.ref(t) for t in pool.keys + pool.values]).result(10)
        assert len(kv) == 2 * runner.model.config.num_hidden_layers
        assert sched.release_memory(["kv_cache"]).result(10)["kv_cache"] > 0
        gc.collect()
        alive = sum(ref() is not None for ref in kv)
        assert alive == 0, f"{alive} of the pool's {len(kv)} KV tensors still reachable"
        sched.resume_memory(["kv_cache"]).result(10)
        assert all(len(t.result().output_ids) == 60 for t in tracked)
    finally:
        sched.stop()
