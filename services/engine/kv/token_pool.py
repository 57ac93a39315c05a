"""The KV token pool: the keys and values of every running request, one token per slot,
handed out a page at a time.

Layout. Per layer, `keys[l]` and `values[l]` of shape [PAGE x (1 + pages), H, D] (H kv
heads, D head dim): slot s holds one token's key and value, after RoPE, and page p is slots
p*PAGE .. p*PAGE + PAGE-1. Page 0 is never handed out; its slot 0 is the null slot that pads
the index tables of requests shorter than their batch's longest (their padding is masked,
and the null slot only ever holds zeros or a spare row's finite key, so 0 x value adds
nothing). This is SGLang's token_to_kv_pool with its paged allocator (--page-size 16): a
request may grow to the model's context as long as the pool has free pages, whatever the
others hold.

Why pages. A decode step gathers each row's keys by slot (executor/paged_attention.py). Handed out a
slot at a time from a free list that requests keep churning, a row's keys end up scattered
over the pool; on pages, the gather reads runs of 16 (bench/bench_attention.py, "a slot at a
time": 1.0-1.3x for 64 rows of 100 tokens, 1.2-1.45x for a 4096-token row beside 63 short
ones, on the CPU). A page costs up to PAGE-1 slots of a request's last page, as in SGLang.

Allocation (host side, between steps, on the scheduler thread). `alloc(sizes)` gives each
run its own fresh pages and returns its first sizes[i] slots; a running row fills the rest of
its last page before it takes a new one (`take_pages`, `claim`: paged_batch.py). The holders
of a slot: a running row (its index table lists it), a prefill that has not handed its slots
to rows yet, the prefix cache. The n copies of a GRPO prompt hold the same prompt slots, each
once, so the prompt's keys are computed and stored once. A page goes back to the free pages
when no slot of it is held.

The books are per page, and no call costs what the pool's size does (a tiny model's pool on
a 141 GB GPU is ~300M tokens; a colocated run allocates it at every resume):
  - `refs_P[p]` counts the slot holds in page p (each holder once for each slot of p it
    holds): a page is free when its count falls to 0, so hold, claim and drop cost what the
    slots they name do;
  - returned pages go on a stack (`_stack_P`, `_top`), popped LIFO;
  - pages never handed out since the last allocation are `_fresh` and up, handed out in
    ascending order (page 1 first) once the stack is empty; a page's count is set when it is
    first handed out, and growing the pool (the CPU) only moves the fresh pages' end.
Both arrays are made once, at the limit's size, with torch.empty: memory the host maps as it
is first written, so an allocation (a resume) only resets `_top` and `_fresh`.

Size. The pool is given its `capacity` and `limit` (kv/sizing.py decides both) and holds
them in whole pages. On a GPU the two are equal and the pool is allocated once; CUDA graphs
hold its address, so it never moves. On the CPU it starts at `capacity` and doubles when a
step needs more, up to `limit`. Releasing it
(/release_memory_occupation kv_cache, colocation) frees the tensors; resuming allocates the
starting size again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .sizing import kv_bytes_per_token, kv_shape

log = logging.getLogger(__name__)

NULL_SLOT = 0
PAGE = 16  # slots a page: the unit of allocation and of the prefix cache (SGLang's page size)


def pages_for(tokens: int) -> int:
    """Pages that hold `tokens` tokens."""
    return -(-tokens // PAGE)


def whole_pages(tokens: int) -> int:
    """`tokens` rounded down to whole pages, at least one page (SGLang rounds its
    max_total_num_tokens down to its page size)."""
    return max(PAGE, tokens // PAGE * PAGE)


class PoolFull(Exception):
    """The pool has fewer free tokens than asked for, even grown to its limit."""


class TokenPool:
    def __init__(
        self,
        config: Any,
        capacity: int,
        dtype: torch.dtype,
        device: Any,
        *,
        limit: int | None = None,
    ):
        self.layers, self.heads, self.head_dim = kv_shape(config)
        self.dtype, self.device = dtype, torch.device(device)
        self.initial = whole_pages(capacity)
        self.limit = max(whole_pages(limit or capacity), self.initial)
        self.bytes_per_token = kv_bytes_per_token(config, dtype)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        pages = self.limit // PAGE
        self.refs_P = torch.empty(1 + pages, dtype=torch.int32)  # page 0: never handed out
        self._stack_P = torch.empty(pages, dtype=torch.int32)
        self._top = 0
        self._fresh = 1
        self.allocate()

    # ---- memory ------------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    @property
    def can_grow(self) -> bool:
        return self.device.type != "cuda" and self.capacity < self.limit

    def allocate(self) -> int:
        """Allocate the starting size, every slot free (zeroed); returns the bytes."""
        self.free_memory()
        self._grow_to(self.initial)
        return self.nbytes

    def free_memory(self) -> int:
        """Drop the tensors (every row was retracted first); returns the bytes freed."""
        nbytes = self.nbytes
        self.keys, self.values = [], []
        self.capacity = 0
        self._top, self._fresh = 0, 1  # every page free, none handed out
        return nbytes

    def _grow_to(self, capacity: int) -> None:
        old = self.capacity
        shape = (PAGE + capacity, self.heads, self.head_dim)
        grown_k, grown_v = [], []
        for layer in range(self.layers):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old:
                k[: PAGE + old] = self.keys[layer]
                v[: PAGE + old] = self.values[layer]
            grown_k.append(k)
            grown_v.append(v)
        self.keys, self.values = grown_k, grown_v
        self.capacity = capacity  # its new pages are fresh: handed out after the old ones
        if old:
            log.info("KV token pool grown to %d tokens (%.1f MiB)", capacity, self.nbytes / 2**20)

    # ---- pages and slots ----------------------------------------------------------------

    @property
    def free_tokens(self) -> int:
        """Slots in free pages (a running row's last page may have a few more)."""
        return PAGE * (self._top + self.capacity // PAGE + 1 - self._fresh)

    @property
    def used_tokens(self) -> int:
        return self.capacity - self.free_tokens

    @property
    def available(self) -> int:
        """Free tokens, counting what the pool may still grow by."""
        return self.free_tokens + (self.limit - self.capacity if self.can_grow else 0)

    def ensure(self, tokens: int) -> bool:
        """Whether `tokens` slots (whole pages) are free, growing the pool first if it may."""
        need = PAGE * pages_for(tokens)
        if need > self.free_tokens and self.can_grow:
            want = max(self.capacity * 2, self.used_tokens + need)
            self._grow_to(min(self.limit, want))
        return need <= self.free_tokens

    def take_pages(self, count: int) -> torch.Tensor:
        """The first slots of `count` free pages, held by no one yet (`claim` their slots
        as they are written): returned pages first, the last returned first, then fresh
        ones in ascending order; PoolFull if the pool, grown to its limit, has fewer."""
        if not self.ensure(PAGE * count):
            raise PoolFull(
                f"{PAGE * count} tokens asked for, {self.free_tokens} free of {self.capacity}"
            )
        popped = min(count, self._top)
        returned = self._stack_P[self._top - popped : self._top].flip(0)
        self._top -= popped
        first, self._fresh = self._fresh, self._fresh + count - popped
        self.refs_P[first : self._fresh].zero_()  # their books start here
        fresh = torch.arange(first, self._fresh, dtype=torch.int32)
        return torch.cat([returned, fresh]).long() * PAGE

    def claim(self, slots: torch.Tensor) -> None:
        """Hold `slots` of pages this holder took (once each): the first hold of those
        slots, counted as any other."""
        self.hold(slots)

    def alloc(self, sizes: int | list[int]) -> torch.Tensor:
        """Slots for runs of `sizes` tokens (one int: one run), each run on pages of its
        own, every slot held once; concatenated in order. PoolFull if they do not fit."""
        sizes = [sizes] if isinstance(sizes, int) else sizes
        firsts = self.take_pages(sum(pages_for(n) for n in sizes))
        runs, at = [], 0
        for n in sizes:
            count = pages_for(n)
            page_slots = firsts[at : at + count, None] + torch.arange(PAGE)
            runs.append(page_slots.reshape(-1)[:n])
            at += count
        slots = torch.cat(runs) if runs else firsts
        self.claim(slots)
        return slots

    def hold(self, slots: torch.Tensor) -> None:
        """One more holder of each of `slots` (a row sharing a prefill's prompt)."""
        pages = slots // PAGE
        self.refs_P.index_add_(0, pages, torch.ones_like(pages, dtype=torch.int32))

    def drop(self, slots: torch.Tensor) -> int:
        """One holder less of each of `slots` (repeats count); the pages of which no slot
        is held any more go back to the free stack. Returns the slots freed (whole pages)."""
        if slots.numel() == 0:
            return 0
        pages = slots // PAGE
        self.refs_P.index_add_(0, pages, torch.full_like(pages, -1, dtype=torch.int32))
        candidates = pages.unique()  # ascending
        held = self.refs_P[candidates]
        handed_out = int(candidates[0]) > 0 and int(candidates[-1]) < self._fresh
        assert handed_out and bool((held >= 0).all()), "a KV slot was dropped more than held"
        freed = candidates[held == 0]
        count = len(freed)
        # the lowest on top: the next take_pages hands them out in ascending order
        self._stack_P[self._top : self._top + count] = freed.flip(0)
        self._top += count
        return PAGE * count
