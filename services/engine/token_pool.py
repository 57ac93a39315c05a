"""The KV token pool: the keys and values of every running request, one token per slot.

Layout. Per layer, `keys[l]` and `values[l]` of shape [1 + capacity, H, D] (H kv heads, D
head dim): slot s holds one token's key and value, after RoPE. Slot 0 is the null slot:
never handed out, it pads the index tables of requests shorter than their batch's longest
(their padding is masked, and the null slot only ever holds zeros or a spare row's finite
key, so 0 x value adds nothing). This is SGLang's token_to_kv_pool with a page size of 1:
any free slot can take any request's next token, so a request may grow to the model's
context as long as the pool has free tokens, whatever the others hold.

Allocation (host side, between steps, on the scheduler thread). `free` is a stack of free
slot ids; `refs[s]` counts who holds slot s: a running row (its index table lists s), a
prefill that has not handed its slots to rows yet. The n copies of a GRPO prompt hold the
same prompt slots, each once, so the prompt's keys are computed and stored once. A slot
goes back to `free` when its count drops to 0.

Size. On a GPU the pool is allocated once, at the size SGLang would give it: --max-total-
tokens, else what --mem-fraction-static leaves (model_runner.kv_token_budget); CUDA graphs
hold its address, so it never moves. On the CPU it starts small and doubles when a step
needs more, up to its limit (--max-total-tokens, else a share of the host's memory): a
laptop does not pay for a pool it never fills. Releasing it (/release_memory_occupation
kv_cache, colocation) frees the tensors; resuming allocates the starting size again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

NULL_SLOT = 0


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a Hugging Face decoder config."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, heads, head_dim


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
        self.initial = capacity
        self.limit = max(limit or capacity, capacity)
        self.bytes_per_token = (
            2
            * self.layers
            * self.heads
            * self.head_dim
            * torch.empty((), dtype=dtype).element_size()
        )
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.capacity = 0
        self.refs = torch.zeros(1, dtype=torch.int32)
        self.free_ids = torch.zeros(0, dtype=torch.long)
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
        self.capacity = 0
        self.keys, self.values = [], []
        self.refs = torch.zeros(1, dtype=torch.int32)
        self.free_ids = torch.zeros(0, dtype=torch.long)
        self._grow_to(self.initial)
        return self.nbytes

    def free_memory(self) -> int:
        """Drop the tensors (every row was retracted first); returns the bytes freed."""
        nbytes = self.nbytes
        self.keys, self.values = [], []
        self.capacity = 0
        self.refs = torch.zeros(1, dtype=torch.int32)
        self.free_ids = torch.zeros(0, dtype=torch.long)
        return nbytes

    def _grow_to(self, capacity: int) -> None:
        old = self.capacity
        shape = (1 + capacity, self.heads, self.head_dim)
        grown_k, grown_v = [], []
        for layer in range(self.layers):
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old:
                k[: 1 + old] = self.keys[layer]
                v[: 1 + old] = self.values[layer]
            grown_k.append(k)
            grown_v.append(v)
        self.keys, self.values = grown_k, grown_v
        refs = torch.zeros(1 + capacity, dtype=torch.int32)
        refs[: 1 + old] = self.refs
        self.refs = refs
        new_ids = torch.arange(capacity, old, -1, dtype=torch.long)  # popped lowest first
        self.free_ids = torch.cat([new_ids, self.free_ids])
        self.capacity = capacity
        if old:
            log.info("KV token pool grown to %d tokens (%.1f MiB)", capacity, self.nbytes / 2**20)

    # ---- slots -------------------------------------------------------------------------

    @property
    def free_tokens(self) -> int:
        return len(self.free_ids)

    @property
    def used_tokens(self) -> int:
        return self.capacity - self.free_tokens

    @property
    def available(self) -> int:
        """Free tokens, counting what the pool may still grow by."""
        return self.free_tokens + (self.limit - self.capacity if self.can_grow else 0)

    def ensure(self, n: int) -> bool:
        """Whether `n` slots are free, growing the pool first if it may."""
        if n > self.free_tokens and self.can_grow:
            want = max(self.capacity * 2, self.used_tokens + n)
            self._grow_to(min(self.limit, want))
        return n <= self.free_tokens

    def alloc(self, n: int) -> torch.Tensor:
        """`n` free slots (held once each), growing the pool if it may; PoolFull if not."""
        if not self.ensure(n):
            raise PoolFull(f"{n} tokens asked for, {self.free_tokens} free of {self.capacity}")
        # The stack's top is its end: popping there keeps the rest of free_ids in place.
        slots = self.free_ids[len(self.free_ids) - n :].flip(0)
        self.free_ids = self.free_ids[: len(self.free_ids) - n]
        self.refs[slots] = 1
        return slots

    def hold(self, slots: torch.Tensor) -> None:
        """One more holder of each of `slots` (a row sharing a prefill's prompt)."""
        self.refs.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))

    def drop(self, slots: torch.Tensor) -> int:
        """One holder less of each of `slots` (repeats count); those no one holds go back
        to the free stack. Returns how many were freed."""
        if slots.numel() == 0:
            return 0
        self.refs.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        candidates = slots.unique()
        freed = candidates[self.refs[candidates] == 0]
        assert bool((self.refs[candidates] >= 0).all()), "a KV slot was dropped more than held"
        self.free_ids = torch.cat([self.free_ids, freed.flip(0)])
        return len(freed)
