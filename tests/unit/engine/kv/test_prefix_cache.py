"""The prefix cache (engine/kv/prefix_cache.py): pages kept after a row leaves and reused by the
next prefill that starts the same way, with exact logprobs, evicted least recently used
first, never reused after a weight update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.kv.prefix_cache import PAGE, PrefixCache
from millstream.engine.kv.token_pool import TokenPool
from millstream.engine.paged_batch import EVICT_BATCH
from millstream.engine.weights import WeightLoader
from tests.support.engine_scheduler import engine_scheduler
from tests.unit.engine.kv.test_token_pool import _batch, send_back, weights_of
from tests.unit.engine.test_engine_scheduler import PROMPTS, Tracked, full_forward_logprobs

pytestmark = pytest.mark.timeout(120)


def test_pages_are_matched_locked_and_evicted_least_recently_used_first(runner: ModelRunner):
    pool = TokenPool(runner.model.config, 256, runner.dtype, "cpu")
    cache = PrefixCache(pool)
    a, b = list(range(40)), list(range(32)) + [99] * 8
    slots_a, slots_b = pool.alloc(40), pool.alloc(40)
    cache.insert(a, slots_a)  # 2 whole pages kept; the last 8 tokens are no page
    cache.insert(b, slots_b)  # shares a's 2 pages: nothing new
    assert cache.tokens == 2 * PAGE == cache.evictable
    pool.drop(slots_a), pool.drop(slots_b)
    assert pool.used_tokens == 2 * PAGE  # the cache's hold alone

    nodes = cache.match(b, limit=len(b) - 1)
    assert [n.slots.tolist() for n in nodes] == [slots_a[:16].tolist(), slots_a[16:32].tolist()]
    assert len(cache.match(a, limit=31)) == 1  # whole pages within the limit only
    cache.lock(nodes)
    assert cache.evictable == 0 and cache.evict(100) == 0  # locked: kept
    cache.unlock(nodes)
    c = [7] * 16
    cache.insert(c, pool.alloc(16))
    pool.drop(cache.match(c, 16)[0].slots)  # held by the cache alone now
    cache.match(a, limit=32)  # a's path used after c: c is the least recently used
    assert cache.evict(1) == PAGE and cache.match(c, 16) == []
    assert cache.flush() == 2 * PAGE and pool.used_tokens == 0 and cache.epoch == 1


def test_one_eviction_takes_a_whole_path_and_counts_only_the_slots_it_frees(runner: ModelRunner):
    pool = TokenPool(runner.model.config, 256, runner.dtype, "cpu")
    cache = PrefixCache(pool)
    long, short = list(range(64)), [5] * 32
    kept = pool.alloc(64)
    cache.insert(long, kept)  # a path of 4 pages whose slots a running row still holds
    slots = pool.alloc(32)
    cache.insert(short, slots)
    pool.drop(slots)  # the cache alone holds short's 2 pages
    cache.match(long, 64)  # short is the least recently used
    # short's leaf, then its parent (a leaf once its child is gone): 2 pages freed
    assert cache.evict(2 * PAGE) == 2 * PAGE and cache.match(short, 32) == []
    assert cache.tokens == 4 * PAGE and pool.used_tokens == 64
    # long's 4 pages go leaf by leaf in one call, but the row's hold keeps every slot
    assert cache.evict(PAGE) == 0 and cache.tokens == cache.evictable == 0
    assert pool.used_tokens == 64 and pool.drop(kept) == 64


def test_a_full_pool_evicts_a_batch_at_a_time_not_a_page_a_step(runner: ModelRunner):
    """A decode step asks for a page a row whose last page is full; with the pool full of
    cached pages, the cache gives up EVICT_BATCH tokens at once, so the next steps find free
    pages without a walk."""
    batch = _batch(runner, 512)
    pages = 2 * EVICT_BATCH // PAGE
    slots = batch.pool.alloc(pages * PAGE)
    batch.cache.insert([t for p in range(pages) for t in [p] * PAGE], slots)
    batch.pool.drop(slots)  # the cache alone holds them
    batch.pool.alloc(batch.pool.free_tokens)  # running rows hold the rest: nothing free
    assert batch.make_free(PAGE) and batch.pool.free_tokens == EVICT_BATCH
    assert batch.cache.tokens == pages * PAGE - EVICT_BATCH
    for _ in range(EVICT_BATCH // PAGE - 1):  # a step's page taken each time: no eviction
        assert batch.make_free(PAGE) and batch.pool.alloc(PAGE) is not None
        assert batch.cache.tokens == pages * PAGE - EVICT_BATCH


def test_a_resumed_rollout_prefills_only_what_the_cache_lacks(runner: ModelRunner, reference):
    """A request finishes; a second one whose prompt is the first's prompt and output (a
    partial rollout sent back to continue) reuses the cached pages: only the tail is
    computed, and its logprobs still equal a full forward. A weight update drops the cache:
    the same request then computes everything again."""
    sched = engine_scheduler(runner, max_running_requests=4)
    batch = sched._batch
    sched.start()
    try:
        first = Tracked("first", PROMPTS[2], max_new_tokens=40, ignore_eos=True, temperature=0)
        sched.submit([first.seq])
        first.result()
        on_thread = sched.call(lambda: batch.cache.tokens).result(10)  # after the row left
        assert on_thread == (len(PROMPTS[2]) + 40 - 1) // PAGE * PAGE

        resumed_prompt = first.seq.prompt_ids + first.seq.output_ids
        resumed = Tracked("resumed", resumed_prompt, seed=5, max_new_tokens=20, ignore_eos=True)
        computed: list[int] = []
        prefill = batch.prefill
        batch.prefill = lambda *a: (  # type: ignore[method-assign]
            _out := prefill(*a),
            computed.append(len(batch.last_plan.write_slots)),
        )[0]
        sched.submit([resumed.seq])
        resumed.result()
        cached = (len(resumed_prompt) - 1) // PAGE * PAGE
        assert computed == [len(resumed_prompt) - cached] and batch.cache.hits == cached
        expected = full_forward_logprobs(reference, resumed.seq)
        got = torch.tensor(resumed.seq.output_logprobs)
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()

        send_back(sched, WeightLoader(runner.model), weights_of(runner))
        assert batch.cache.tokens == 0
        again = Tracked("again", resumed_prompt, seed=5, max_new_tokens=20, ignore_eos=True)
        sched.submit([again.seq])
        assert again.result().output_ids == resumed.seq.output_ids
        assert computed[-1] == len(resumed_prompt)
        sched.call(lambda: None).result(10)  # the step in which `again` left is over
        assert sched.flush_cache().result(10) > 0  # again's pages, dropped by /flush_cache
        assert batch.cache.tokens == 0 and batch.used_tokens == 0
    finally:
        sched.stop()


def test_a_row_running_through_an_update_to_new_weights_leaves_no_old_keys_behind(
    tiny_model_dir: Path,
):
    """A row decodes while the weights are updated to DIFFERENT ones (paused in place, as a
    trainer's sync pauses the engine): its prompt's keys were computed with the old weights,
    so when it finishes its pages must stay out of the prefix cache (the epoch check of
    paged_batch.keep). A prompt that starts as the row's did (its 4 whole pages) is served
    next: its logprobs equal a full forward of the new weights. (Every other update test
    sends the same weights back, where old keys would give the same output.)"""
    runner = ModelRunner(str(tiny_model_dir))  # its own: its weights change
    noise = torch.Generator().manual_seed(7)
    new = [(n, t + 0.05 * torch.randn(t.shape, generator=noise)) for n, t in weights_of(runner)]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    with torch.no_grad():
        for name, t in new:
            reference.get_parameter(name).copy_(t)
    sched = engine_scheduler(runner, max_running_requests=4)
    batch = sched._batch
    sched.start()
    try:
        prompt = PROMPTS[2]
        assert len(prompt) >= 4 * PAGE
        row = Tracked("row", prompt, max_new_tokens=30, ignore_eos=True)
        sched.submit([row.seq])
        row.wait_tokens(3)
        sched.pause("in_place").result(10)
        assert sched.call(lambda: any(s is row.seq for s in batch.seqs)).result(10)
        send_back(sched, WeightLoader(runner.model), new)
        sched.resume().result(10)
        row.result()
        later = Tracked("later", prompt + list(b" Again."), seed=3, max_new_tokens=12)
        sched.submit([later.seq])
        expected = full_forward_logprobs(reference.eval(), later.result())
        got = torch.tensor(later.seq.output_logprobs)
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    finally:
        sched.stop()
