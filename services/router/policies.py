"""How the router picks one worker for a request: small policies behind one interface.

    policy.choose(candidates, key) -> Worker   # candidates: eligible workers, non-empty

`key` is the request's routing key (its input ids, or its text), only computed for policies
that set `needs_key`. Policies never see ineligible workers and never mutate load; the
registry owns in-flight counts.

least_inflight (default): the fewest requests in flight; ties go round robin, so an idle
    fleet still spreads requests.
round_robin: the next worker in registration order, whatever its load.
cache_aware (after sglang-router's): send a request to the worker that has served the
    longest prefix of it, so the engine's prefix (KV) cache hits, unless load is imbalanced:
        imbalanced = max_if - min_if > balance_abs_threshold and max_if > balance_rel_threshold * min_if
    imbalanced -> least in-flight; else if matched / len(key) >= cache_threshold -> the best
    matching worker; else -> least in-flight (ties: the worker caching the least).
    The prefix index hashes the key in blocks of `block` elements, each hash chained with the
    one before, so block i's hash stands for the whole prefix up to it; a table maps each hash
    to the workers that served it. The trailing partial block is indexed too, so identical
    prompts (n samples of one prompt) land together. Least-recently-used hashes are evicted
    beyond `max_blocks`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from .registry import Worker

RouteKey = tuple[int, ...] | str


class Policy(Protocol):
    name: str
    needs_key: bool

    def choose(self, candidates: Sequence[Worker], key: RouteKey | None = None) -> Worker: ...

    def forget(self, worker: Worker) -> None: ...


class RoundRobin:
    name = "round_robin"
    needs_key = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker], key: RouteKey | None = None) -> Worker:
        return candidates[next(self._counter) % len(candidates)]

    def forget(self, worker: Worker) -> None:
        pass


class LeastInflight:
    name = "least_inflight"
    needs_key = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Worker], key: RouteKey | None = None) -> Worker:
        low = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == low]
        return tied[next(self._counter) % len(tied)]

    def forget(self, worker: Worker) -> None:
        pass


class CacheAware:
    name = "cache_aware"
    needs_key = True

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_blocks: int = 1_000_000,
        block: int = 16,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_blocks = max_blocks
        self.block = block
        self._table: OrderedDict[int, set[str]] = OrderedDict()  # prefix hash -> worker ids
        self._cached: dict[str, int] = {}  # worker id -> blocks indexed for it
        self._fallback = LeastInflight()

    def imbalanced(self, candidates: Sequence[Worker]) -> bool:
        loads = [w.in_flight for w in candidates]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, candidates: Sequence[Worker], key: RouteKey | None = None) -> Worker:
        if not key or len(candidates) == 1 or self.imbalanced(candidates):
            chosen = self._fallback.choose(candidates)
        else:
            matched = self.match(key, candidates)
            best = max(candidates, key=lambda w: matched.get(w.id, 0))
            if matched.get(best.id, 0) / len(key) >= self.cache_threshold and matched.get(best.id):
                chosen = best
            else:
                chosen = self._least_loaded(candidates)
        if key:
            self._insert(key, chosen.id)
        return chosen

    def _least_loaded(self, candidates: Sequence[Worker]) -> Worker:
        low = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == low]
        fewest = min(self._cached.get(w.id, 0) for w in tied)
        return self._fallback.choose([w for w in tied if self._cached.get(w.id, 0) == fewest])

    def _hashes(self, key: RouteKey) -> list[tuple[int, int]]:
        """(chained hash, elements covered) per block, the trailing partial block included."""
        out, h = [], 0
        for start in range(0, len(key), self.block):
            piece = key[start : start + self.block]
            h = hash((h, piece))
            out.append((h, start + len(piece)))
        return out

    def match(self, key: RouteKey, candidates: Sequence[Worker]) -> dict[str, int]:
        """Worker id -> how many leading elements of `key` it has served (block granular)."""
        wanted = {w.id for w in candidates}
        matched: dict[str, int] = {}
        for h, covered in self._hashes(key):
            owners = self._table.get(h)
            if not owners or not owners & wanted:
                break
            for worker_id in owners & wanted:
                matched[worker_id] = covered
        return matched

    def _insert(self, key: RouteKey, worker_id: str) -> None:
        for h, _ in self._hashes(key):
            owners = self._table.get(h)
            if owners is None:
                owners = self._table[h] = set()
            else:
                self._table.move_to_end(h)
            if worker_id not in owners:
                owners.add(worker_id)
                self._cached[worker_id] = self._cached.get(worker_id, 0) + 1
        while len(self._table) > self.max_blocks:
            _, owners = self._table.popitem(last=False)
            for worker_id in owners:
                self._cached[worker_id] -= 1

    def forget(self, worker: Worker) -> None:
        for h in [h for h, owners in self._table.items() if worker.id in owners]:
            owners = self._table[h]
            owners.discard(worker.id)
            if not owners:
                del self._table[h]
        self._cached.pop(worker.id, None)

    @property
    def size(self) -> int:
        return len(self._table)


def make_policy(
    name: str,
    *,
    cache_threshold: float = 0.3,
    balance_abs_threshold: int = 32,
    balance_rel_threshold: float = 1.5,
    max_tree_size: int = 1_000_000,
) -> Policy:
    if name == "least_inflight":
        return LeastInflight()
    if name == "round_robin":
        return RoundRobin()
    if name == "cache_aware":
        return CacheAware(
            cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size
        )
    raise ValueError(f"unknown router policy {name!r}")


def route_key(payload: object) -> RouteKey | None:
    """The routing key of a parsed JSON request body, or None when it has none.

    SGLang /generate: `input_ids` (one list of ints) or `text`; OpenAI completions: `prompt`;
    chat: the concatenated message contents. Batched requests use their first item.
    """
    if not isinstance(payload, dict):
        return None
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids:
        if isinstance(ids[0], list):
            ids = ids[0]
        if all(isinstance(t, int) for t in ids):
            return tuple(ids)
    for field in ("text", "prompt"):
        value = payload.get(field)
        if isinstance(value, list) and value and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, str) and value:
            return value
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        text = "".join(p for p in parts if isinstance(p, str))
        return text or None
    return None
