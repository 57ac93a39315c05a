"""The prefix cache: the keys of token sequences that finished or left, kept in the pool for
the next request that starts the same way (SGLang's radix cache, in pages).

A tree of pages: each node below the root is PAGE tokens (the pool's page size) and the
PAGE pool slots holding their keys and values, its children the pages that followed it in
some sequence. A row that leaves the running batch (finished, aborted, retracted) inserts
its context: each of its whole pages that the tree lacks becomes a node, and the cache
holds those slots (one more holder in the pool's count, token_pool.py), so they outlive the
row. A new prefill walks the tree with its prefix and reuses the slots of every page it
matches: only the rest is computed. What this buys in RL: a partial rollout resumed on the
same engine, a retracted row prefilled again, a multi-turn prompt that extends the last
turn.

Locks. A row that reused a path locks it (every node from the root to the deepest one it
matched); a locked node is never evicted. Nodes no row locks are `evictable`: when the pool
is short, the least recently used unlocked leaves go first (their slots freed), before the
pool grows (the CPU) or a row is retracted.

Staleness. Keys depend on the weights. A weight update that asks for it (flush_cache, the
trainer's default unless it pauses in place) and /flush_cache drop every unlocked node and
start a new epoch; a row prefilled in an earlier epoch never inserts its keys afterwards,
so nothing computed with old weights is reused after a flush. (With an in-place pause and
no flush, rows keep their old keys, as in SGLang.)
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from .token_pool import PAGE, TokenPool


@dataclass(eq=False)
class Node:
    key: tuple[int, ...]
    slots: torch.Tensor  # [PAGE] pool slots (host)
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    locks: int = 0
    used: int = 0  # the cache's clock at the last match or insert


class PrefixCache:
    def __init__(self, pool: TokenPool):
        self.pool = pool
        self.epoch = 0
        self._root = Node((), torch.zeros(0, dtype=torch.long), None)
        self._clock = itertools.count(1)
        self.tokens = 0  # in nodes
        self.evictable = 0  # in unlocked nodes
        self.hits = 0  # tokens reused by prefills

    def match(self, tokens: list[int], limit: int) -> list[Node]:
        """The nodes of the longest cached path that `tokens` starts with, at most `limit`
        tokens (whole pages)."""
        nodes: list[Node] = []
        node, now = self._root, next(self._clock)
        for start in range(0, limit - PAGE + 1, PAGE):
            child = node.children.get(tuple(tokens[start : start + PAGE]))
            if child is None:
                break
            child.used = now
            nodes.append(child)
            node = child
        return nodes

    def lock(self, nodes: list[Node]) -> None:
        for node in nodes:
            if node.locks == 0:
                self.evictable -= PAGE
            node.locks += 1

    def unlock(self, nodes: list[Node]) -> None:
        for node in nodes:
            node.locks -= 1
            assert node.locks >= 0, "a prefix cache node unlocked more than locked"
            if node.locks == 0:
                self.evictable += PAGE

    def insert(self, tokens: list[int], slots: torch.Tensor) -> None:
        """Keep the whole pages of `tokens` (keys in `slots`) that the tree lacks."""
        node, now = self._root, next(self._clock)
        for start in range(0, len(tokens) - PAGE + 1, PAGE):
            key = tuple(tokens[start : start + PAGE])
            child = node.children.get(key)
            if child is None:
                page = slots[start : start + PAGE].clone()
                self.pool.hold(page)
                child = node.children[key] = Node(key, page, node)
                self.tokens += PAGE
                self.evictable += PAGE
            child.used = now
            node = child

    def evict(self, tokens: int) -> int:
        """Drop unlocked leaves, least recently used first (a parent left without children
        is a leaf then), until `tokens` pool slots were freed or none is left; returns the
        slots freed. One walk of the tree; the pages go to the pool in batches of what is
        still missing (a page a running row also holds frees nothing)."""
        heap = [(leaf.used, id(leaf), leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < tokens:
            gone: list[torch.Tensor] = []
            while heap and PAGE * len(gone) < tokens - freed:
                _, _, leaf = heapq.heappop(heap)
                parent = leaf.parent
                assert parent is not None and not leaf.children and leaf.locks == 0
                del parent.children[leaf.key]
                gone.append(leaf.slots)
                if parent is not self._root and not parent.children and parent.locks == 0:
                    heapq.heappush(heap, (parent.used, id(parent), parent))
            self.tokens -= PAGE * len(gone)
            self.evictable -= PAGE * len(gone)
            freed += self.pool.drop(torch.cat(gone))
        return freed

    def flush(self) -> int:
        """Drop every unlocked node and start a new epoch; returns the tokens dropped."""
        self.epoch += 1
        before = self.tokens
        self.evict(self.pool.capacity + 1)
        return before - self.tokens

    def forget(self) -> None:
        """The pool's memory is gone (released): forget every node without freeing."""
        self.epoch += 1
        self._root.children.clear()
        self.tokens = self.evictable = 0

    def _unlocked_leaves(self) -> list[Node]:
        leaves, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.locks == 0:
                leaves.append(node)
        return leaves
