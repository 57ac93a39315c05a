"""How one training step's samples are split, across data-parallel ranks and into micro-batches.

Three splits, each a list of parts holding sample indices (every index exactly once, each
part sorted ascending), computed from plain token lengths so every rank gets the same answer
on its own without talking to the others:

- `contiguous_shards`: the default rank split. Rank r takes a contiguous range; sizes differ
  by at most one, the first `n % world_size` ranks take the extra sample.
- `balance_across_ranks` (Miles' `--balance-data`): give every rank about the same number of
  tokens, so no rank waits on one that drew the long samples. Greedy longest-processing-time:
  longest sample first (ties by index), each to the rank with the fewest tokens so far (ties
  by fewer samples, then by rank). The spread max - min never exceeds the longest sample.
- `pack_by_tokens` (Miles' `--use-dynamic-batch-size` with `--max-tokens-per-gpu`): cut one
  rank's samples into micro-batches of at most `max_tokens` tokens. First-fit decreasing:
  longest first (ties by index), each into the first micro-batch it fits. No two resulting
  micro-batches could be merged under the cap. A sample longer than the cap is never dropped
  or split; it goes alone in its own micro-batch. Given each sample's prompt (the
  shared-prompt layout, backends/shared_prefix.py), the cap counts the tokens the layout runs:
  a sample whose prompt a micro-batch holds already adds only its response, and it goes to
  such a micro-batch first; the samples of one prompt are placed one after another, groups
  largest first, so a group that fits stays whole.

None of these changes the gradient. The loss of every micro-batch on every rank is divided
by the counts of the whole global batch (tokens or samples), not by its own, so the summed
micro-batch gradients, all-reduced over ranks, are the whole batch's gradient whatever the
split. The splits only change speed and peak memory.
"""

from __future__ import annotations

import heapq


def _check_lengths(lengths: list[int]) -> None:
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"lengths[{i}] = {n}: sample lengths must be >= 0")


def _longest_first(lengths: list[int]) -> list[int]:
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _largest_group_first(lengths: list[int], prompts: list[tuple[int, ...]]) -> list[int]:
    """The samples of one prompt next to each other (so they fill the same micro-batch),
    groups by the tokens they run (the prompt once, every response), largest first."""
    size: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], int] = {}
    for i, (n, p) in enumerate(zip(lengths, prompts, strict=True)):
        size[p] = size.get(p, len(p)) + n - len(p)
        first.setdefault(p, i)
    return sorted(
        range(len(lengths)),
        key=lambda i: (-size[prompts[i]], first[prompts[i]], -lengths[i], i),
    )


def pack_by_tokens(
    lengths: list[int],
    max_tokens: int,
    prompts: list[tuple[int, ...]] | None = None,
) -> list[list[int]]:
    """Micro-batches of sample indices whose lengths sum to <= max_tokens (`prompts`: each
    sample's prompt tokens, counted once per micro-batch; module docstring).

    A sample longer than max_tokens is alone in its micro-batch. Micro-batches are ordered by
    their first index. Deterministic; [] for no samples.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens = {max_tokens}: the per-micro-batch token cap must be > 0")
    _check_lengths(lengths)
    bins: list[list[int]] = []
    loads: list[int] = []
    held: list[set[tuple[int, ...]]] = []  # the prompts each micro-batch holds

    def cost(i: int, b: int) -> int:
        if prompts is not None and prompts[i] in held[b]:
            return lengths[i] - len(prompts[i])
        return lengths[i]

    for i in _longest_first(lengths) if prompts is None else _largest_group_first(lengths, prompts):
        order = range(len(bins))
        if prompts is not None:  # those holding its prompt first
            order = sorted(order, key=lambda b: prompts[i] not in held[b])
        for b in order:
            if loads[b] + cost(i, b) <= max_tokens:
                loads[b] += cost(i, b)
                bins[b].append(i)
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
            held.append(set())
            b = len(bins) - 1
        if prompts is not None:
            held[b].add(prompts[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def balance_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Exactly world_size parts of sample indices with token sums as even as greedy gets.

    Part r is rank r's samples; every part is non-empty. Raises ValueError when there are
    fewer samples than ranks.
    """
    if world_size <= 0:
        raise ValueError(f"world_size = {world_size}: must be > 0")
    if len(lengths) < world_size:
        raise ValueError(
            f"{len(lengths)} samples cannot be balanced over {world_size} ranks: every rank "
            "needs at least one"
        )
    _check_lengths(lengths)
    parts: list[list[int]] = [[] for _ in range(world_size)]
    # (tokens, samples, rank): an empty rank always beats a used one of equal tokens, so
    # zero-length samples still leave no rank empty.
    heap = [(0, 0, r) for r in range(world_size)]
    for i in _longest_first(lengths):
        tokens, count, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], count + 1, r))
    return [sorted(p) for p in parts]


def contiguous_shards(n: int, world_size: int) -> list[list[int]]:
    """Rank r's contiguous range of range(n); the first n % world_size ranks get one extra."""
    if world_size <= 0:
        raise ValueError(f"world_size = {world_size}: must be > 0")
    if n < 0:
        raise ValueError(f"n = {n}: the number of samples must be >= 0")
    base, extra = divmod(n, world_size)
    shards = []
    for r in range(world_size):
        lo = r * base + min(r, extra)
        shards.append(list(range(lo, lo + base + (r < extra))))
    return shards
