"""The running batch over the token pool: rows that decode together, each with its own slots.

State (scheduler thread only). Row r is `seqs[r]`; `table_RL[r, :lens[r]]` lists the pool
slots of its context in order (SGLang's req_to_token), and `lens[r]` counts them: the
prompt and every output token but the last, whose key the next decode step writes. The
table lives on the model's device with one row per --max-running-requests and one column
per token of the context length, so a step's index tensors are slices of it, built without
a Python loop over tokens.

Prefill (`prefill`): the pages the prefix cache has are reused (kv/prefix_cache.py); the
rest of several prompts' tokens are packed into one forward (no padding;
executor/paged_attention.py), their slots allocated at once (each prompt's on pages of its
own) and held by the prefill; `add` gives a row a prefill's context (one more holder of each
slot), so the n copies of a prompt share its keys; `drop` lets the prefill's own hold go,
freeing what no row took. Decode (`decode`): one new slot per row, written by the step: the
next one of the row's last page (a row first fills the rest of its prompt's last page, if no
other copy took it), a fresh page when that is full; the rows' lengths grouped
(executor/paged_attention.py `length_groups`) or, on a GPU with graphs, one captured shape
per batch size and context bucket (executor/decode_graphs.py). Leave (`keep`): a leaving
row's whole pages go to the prefix cache, its own hold on its slots is dropped; the
survivors' table rows move up.

The pool can run out (on a GPU it never grows): before a step the scheduler asks
`make_free` for a page for each row whose last page is full (`step_tokens`; the prefix
cache's unused pages are evicted first, then the CPU's pool grows) and retracts rows until
it gets them (scheduler.py), so no row ever ends for lack of memory while others could make
way. The pool comes sized and allocated (kv/sizing.py; core.py `new_batch` builds the batch
as `millstream engine` runs it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from .executor.decode_graphs import DecodeGraphs
from .executor.host import host_tensor
from .executor.paged_attention import (
    AttnGroup,
    StepPlan,
    decode_group,
    length_groups,
    planned,
    prefill_group,
    use_paged_attention,
)
from .kv.prefix_cache import Node, PrefixCache
from .kv.token_pool import NULL_SLOT, PAGE, PoolFull, TokenPool, pages_for
from .sequence import Sequence

# Tokens the prefix cache gives up at least when the pool is short: a decode step needs one
# slot a row, and evicting just that would walk the cache's tree every step of a full pool.
EVICT_BATCH = 16 * PAGE


@dataclass
class Prefilled:
    """One prefix's context after a prefill: its slots (cached pages first, then the new
    ones), the prefix cache nodes it reused, the cache epoch it was computed in, and the
    unused slots of its last page [first, end) that one row may decode into."""

    slots: torch.Tensor
    nodes: list[Node]
    epoch: int
    tail: tuple[int, int] | None = None


class PagedBatch:
    def __init__(
        self,
        model: Any,
        pool: TokenPool,
        *,
        max_rows: int,
        context_length: int,
        cuda_graph_max_bs: int | None = None,
    ):
        self.model, self.pool = model, pool
        self.max_rows = max_rows
        use_paged_attention(model)
        self.device = pool.device
        self.cache = PrefixCache(pool)
        self.seqs: list[Sequence] = []
        self.lens: list[int] = []
        self._rows: list[Prefilled] = []  # what each row holds besides its own new slots
        # each row's next decode slots: [next, end) of its last page, empty when it is full
        self._next: list[int] = []
        self._end: list[int] = []
        self.context_length = context_length
        # int32, as SGLang's req_to_token: 4 bytes a token of context a row
        self.table_RL = torch.full(
            (max_rows, context_length), NULL_SLOT, dtype=torch.int32, device=self.device
        )
        self.last_plan: StepPlan | None = None  # for tests and stats: what the step read
        self._rows_B = torch.arange(max_rows, device=self.device)
        self.graphs = (
            DecodeGraphs(
                model, pool, max_bs=min(cuda_graph_max_bs, max_rows), context=context_length
            )
            if cuda_graph_max_bs
            else None
        )

    def __len__(self) -> int:
        return len(self.seqs)

    # ---- memory ------------------------------------------------------------------------

    @property
    def used_tokens(self) -> int:
        """Slots held by running rows (the prefix cache's unlocked pages not counted)."""
        return self.pool.used_tokens - self.cache.evictable

    @property
    def available(self) -> int:
        """Slots a step could have: free, the pool's growth, the cache's unlocked pages."""
        return self.pool.available + self.cache.evictable

    @property
    def step_tokens(self) -> int:
        """Slots the next decode step takes from the pool: a page per row whose last page
        is full."""
        return PAGE * sum(a == b for a, b in zip(self._next, self._end, strict=True))

    def make_free(self, tokens: int) -> bool:
        """Free `tokens` slots if possible: the prefix cache's least recently used pages
        first, then the pool's growth (the CPU); whether they are free now."""
        short = tokens - self.pool.free_tokens
        if short > 0:  # at least EVICT_BATCH: a full pool walks the tree once per batch
            self.cache.evict(max(short, EVICT_BATCH))
        return self.pool.ensure(tokens)

    def flush_cache(self) -> int:
        """Drop the prefix cache's unlocked pages (a weight update, /flush_cache)."""
        return self.cache.flush()

    def clear(self) -> None:
        """Every row leaves (its slots dropped)."""
        self.keep([])

    def release(self) -> int:
        """Free the pool (its rows were retracted), keeping no reference to its tensors, so
        their memory really goes; returns the bytes freed."""
        self.clear()
        self.cache.forget()
        self.table_RL.fill_(NULL_SLOT)  # no stale slot past the smaller pool of a resume
        self.forget_graphs()
        self.last_plan = None  # its keys and values are the pool's own lists
        return self.pool.free_memory()

    def resume(self) -> int:
        """Allocate the pool again (zeroed, every slot free); returns its bytes."""
        return self.pool.allocate()

    def forget_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()

    def warm_graphs(self) -> None:
        """Capture the graphs again now, if they were forgotten and no row runs."""
        if self.graphs is not None and not self.graphs.captured and not self.seqs:
            self.graphs.capture_all()

    # ---- prefill -----------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self, prefixes: list[list[int]], keeps: list[int]
    ) -> tuple[list[Prefilled], list[torch.Tensor]]:
        """One packed forward over every prefix's tokens that the prefix cache lacks.
        Returns each prefix's context (held until `drop`) and its logits at its last keeps[u]
        positions ([keeps[u], V]; [-1] is the next-token distribution)."""
        matched = [self.cache.match(p, len(p) - k) for p, k in zip(prefixes, keeps, strict=True)]
        for nodes in matched:
            self.cache.lock(nodes)  # not evicted by this prefill's own allocation
        try:
            cached = [len(nodes) * PAGE for nodes in matched]
            lengths = [len(p) for p in prefixes]
            new = [n - c for n, c in zip(lengths, cached, strict=True)]
            if not self.make_free(PAGE * sum(pages_for(n) for n in new)):
                raise PoolFull(f"a prefill of {sum(new)} tokens, {self.pool.free_tokens} free")
            slots_N = self.pool.alloc(new)  # each prefix's new tokens on pages of their own
        except BaseException:
            for nodes in matched:
                self.cache.unlock(nodes)
            raise
        starts = list(itertools.accumulate(new, initial=0))[:-1]
        handles = []
        for u, nodes in enumerate(matched):
            reused = [n.slots for n in nodes]
            context = torch.cat([*reused, slots_N[starts[u] : starts[u] + new[u]]])
            self.pool.hold(context[: cached[u]])  # the new slots were held by alloc
            last = int(context[-1])
            tail = (last + 1, last // PAGE * PAGE + PAGE) if (last + 1) % PAGE else None
            handles.append(Prefilled(context, nodes, self.cache.epoch, tail if new[u] else None))
            self.cache.hits += cached[u]
        groups = []
        for members in length_groups(lengths):
            width = max(lengths[u] for u in members)
            table_RL = torch.full((len(members), width), NULL_SLOT, dtype=torch.long)
            for r, u in enumerate(members):
                table_RL[r, : lengths[u]] = handles[u].slots
            groups.append(
                prefill_group(
                    [starts[u] for u in members],
                    [new[u] for u in members],
                    [lengths[u] for u in members],
                    table_RL.to(self.device, non_blocking=True),
                )
            )
        plan = StepPlan(
            self.pool.keys, self.pool.values, slots_N.to(self.device, non_blocking=True), groups
        )
        plan.direct = len(groups) == 1 and groups[0].valid is None
        ids = torch.tensor([t for p, c in zip(prefixes, cached, strict=True) for t in p[c:]])
        positions = torch.cat([torch.arange(c, n) for c, n in zip(cached, lengths, strict=True)])
        kept = torch.cat(
            [torch.arange(s + n - k, s + n) for s, n, k in zip(starts, new, keeps, strict=True)]
        )
        try:
            with planned(plan) as mask:
                out = self.model(
                    input_ids=ids[None].to(self.device, non_blocking=True),
                    position_ids=positions[None].to(self.device, non_blocking=True),
                    attention_mask=mask,
                    use_cache=False,
                    logits_to_keep=kept.to(self.device, non_blocking=True),
                )
        except BaseException:
            self.drop(handles)  # nothing leaks from a failed forward
            raise
        self.last_plan = plan
        logits_KV = out.logits[0]
        bounds = list(itertools.accumulate(keeps, initial=0))
        return handles, [logits_KV[a:b] for a, b in itertools.pairwise(bounds)]

    def add(self, seq: Sequence, context: Prefilled) -> None:
        """A new row on a prefill's context (this row holds its slots and locks its nodes)."""
        r = len(self.seqs)
        assert r < self.table_RL.shape[0], f"row {r} of {self.table_RL.shape[0]}"
        self.table_RL[r, : len(context.slots)] = context.slots.to(self.device, torch.int32)
        self.pool.hold(context.slots)
        self.cache.lock(context.nodes)
        self.seqs.append(seq)
        self.lens.append(len(context.slots))
        self._rows.append(context)
        first, end = context.tail or (0, 0)  # the first copy decodes into the last page
        context.tail = None
        self._next.append(first)
        self._end.append(end)

    def drop(self, handles: list[Prefilled]) -> None:
        """A prefill lets go of its contexts: what no row took is free again."""
        for context in handles:
            self.cache.unlock(context.nodes)
        if handles:
            self.pool.drop(torch.cat([c.slots for c in handles]))

    # ---- decode ------------------------------------------------------------------------

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order) in rows 0..len(rows)-1; the others' slots go."""
        if rows == list(range(len(self.seqs))):
            return
        leaving = sorted(set(range(len(self.seqs))) - set(rows))
        if leaving:
            gone = [self.table_RL[r, : self.lens[r]].long().cpu() for r in leaving]
            for r, slots in zip(leaving, gone, strict=True):  # into the prefix cache, unless
                seq, held = self.seqs[r], self._rows[r]  # computed before its last flush
                if held.epoch == self.cache.epoch:
                    self.cache.insert((seq.prompt_ids + seq.output_ids)[: self.lens[r]], slots)
                self.cache.unlock(held.nodes)
            self.pool.drop(torch.cat(gone))
        if rows:
            width = max(self.lens[r] for r in rows)
            index = torch.tensor(rows, device=self.device)
            self.table_RL[: len(rows), :width] = self.table_RL[index, :width]
        self.seqs = [self.seqs[r] for r in rows]
        self.lens = [self.lens[r] for r in rows]
        self._rows = [self._rows[r] for r in rows]
        self._next = [self._next[r] for r in rows]
        self._end = [self._end[r] for r in rows]

    @torch.inference_mode()
    def decode(self, model: Any) -> torch.Tensor:
        """One decode step over every row (a free slot each: the scheduler made room for
        `step_tokens`, with `make_free`); returns next-token logits_BV."""
        n, lens = len(self.seqs), self.lens
        full = [r for r in range(n) if self._next[r] == self._end[r]]
        if full:
            for r, first in zip(full, self.pool.take_pages(len(full)).tolist(), strict=True):
                self._next[r], self._end[r] = first, first + PAGE
        # The step's small vectors in one host tensor (executor/host.py):
        # new slots, their cells of the flattened table, last tokens, positions.
        context = self.table_RL.shape[1]
        step_4B = host_tensor(
            [
                self._next,
                [r * context + p for r, p in enumerate(lens)],
                [s.output_ids[-1] for s in self.seqs],
                lens,
            ]
        )
        self.pool.claim(step_4B[0])
        self._next = [s + 1 for s in self._next]
        self.lens = [p + 1 for p in lens]
        on_device = step_4B.to(self.device, non_blocking=True)
        new_B = on_device[0]
        self.table_RL.view(-1)[on_device[1]] = new_B.int()
        size = self.graphs.size_for(n, max(self.lens)) if self.graphs is not None else None
        if size is not None:
            assert self.graphs is not None
            ids_B, positions_B = on_device[2], on_device[3]
            logits_BV = self.graphs.step(size, n, ids_B, positions_B, new_B, self.table_RL)
            return logits_BV[:n]
        plan = StepPlan(self.pool.keys, self.pool.values, new_B, self._decode_groups())
        plan.direct = len(plan.groups) == 1
        self.last_plan = plan
        with planned(plan) as mask:
            out = model(
                input_ids=on_device[2][None],
                position_ids=on_device[3][None],
                attention_mask=mask,
                use_cache=False,
            )
        return out.logits[0]

    def _decode_groups(self) -> list[AttnGroup]:
        """The step's decode groups by length; one group of every row (the common case)
        slices the table, with no index tensor and, when the rows are as long, no mask."""
        n, lens = len(self.lens), self.lens
        members = length_groups(lens) if n > 1 else [[0]]
        if len(members) == 1:
            width = max(lens)
            lengths_B = None if min(lens) == width else host_tensor(lens, device=self.device)
            return [decode_group(self._rows_B[:n], self.table_RL[:n, :width], lengths_B, width)]
        lengths_B = host_tensor(lens, device=self.device)
        groups = []
        for rows in members:
            width = max(lens[r] for r in rows)
            index = host_tensor(rows, device=self.device)
            ragged = lengths_B[index] if min(lens[r] for r in rows) != width else None
            groups.append(decode_group(index, self.table_RL[index, :width], ragged, width))
        return groups
