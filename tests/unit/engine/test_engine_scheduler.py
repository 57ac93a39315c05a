"""The engine's scheduler in-process (no HTTP): continuous batching, logprobs, stop, pause.

The reference for every logprob is a fresh Hugging Face model, loaded separately from the
same directory, run once over prompt + response (float32): the engine's batched, KV-cached,
left-padded decoding must agree within 1e-4.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import torch

from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.kv.token_pool import PAGE
from millstream.engine.sampling import SamplingParams
from millstream.engine.scheduler import RequestError, Scheduler
from millstream.engine.sequence import Sequence, output_text
from tests.support.engine_scheduler import engine_scheduler

pytestmark = pytest.mark.timeout(120)

PROMPTS = [
    list(b"The quick brown fox"),
    list(b"Hi"),
    list(b"A much longer prompt that spans many byte tokens, to pad others."),
    list(b"1 2 3 4 5"),
]


class Tracked:
    """A Sequence plus events the test can wait on."""

    def __init__(self, rid: str, prompt: list[int], seed: int = 0, **params):
        self.done = threading.Event()
        self.progress = threading.Condition()
        self.seq = Sequence(
            rid=rid,
            prompt_ids=list(prompt),
            params=SamplingParams(**params),
            rng=random.Random(seed),
            notify=self._notify,
        )

    def _notify(self, seq: Sequence) -> None:
        with self.progress:
            self.progress.notify_all()
        if seq.done:
            self.done.set()

    def wait_tokens(self, n: int, timeout: float = 30.0) -> None:
        with self.progress:
            assert self.progress.wait_for(
                lambda: len(self.seq.output_ids) >= n or self.seq.done, timeout
            )

    def result(self, timeout: float = 60.0) -> Sequence:
        assert self.done.wait(timeout), f"{self.seq.rid} did not finish"
        return self.seq


TIGHT_POOL = 96  # tokens: the tests below fill it, and rows are retracted to make room


@pytest.fixture(params=["grown", "tight"])
def scheduler(runner: ModelRunner, request) -> Iterator[Scheduler]:
    """Every scheduler test runs on a pool that grows as the CPU's does, and on one of
    TIGHT_POOL tokens that never grows (a GPU's is fixed): there the rows outgrow it, the
    newest are retracted and prefilled again later, and every result must be the same."""
    tight = request.param == "tight"
    sched = engine_scheduler(
        runner, max_running_requests=8, max_total_tokens=TIGHT_POOL if tight else None
    )
    sched.start()
    yield sched
    sched.stop()


def tight(scheduler: Scheduler) -> bool:
    """Whether `scheduler` runs on the TIGHT_POOL: fewer rows run at once there."""
    return scheduler._batch.pool.limit == TIGHT_POOL


def full_forward_logprobs(model, seq: Sequence, temperature: float = 1.0) -> torch.Tensor:
    ids = seq.prompt_ids + seq.output_ids
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
    start = len(seq.prompt_ids) - 1
    return logp_TV[start : start + len(seq.output_ids)].gather(
        -1, torch.tensor(seq.output_ids)[:, None]
    )[:, 0]


def run(scheduler: Scheduler, *tracked: Tracked) -> list[Sequence]:
    scheduler.submit([t.seq for t in tracked])
    return [t.result() for t in tracked]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    ],
    ids=["greedy", "temp1", "temp0.7-topk-topp"],
)
def test_logprobs_equal_full_forward_with_requests_joining_mid_batch(
    scheduler: Scheduler, reference, params
):
    temperature = params["temperature"] if params["temperature"] > 0 else 1.0
    first = Tracked("a", PROMPTS[0], seed=1, max_new_tokens=24, ignore_eos=True, **params)
    scheduler.submit([first.seq])
    first.wait_tokens(3)
    second = Tracked("b", PROMPTS[1], seed=2, max_new_tokens=12, ignore_eos=True, **params)
    scheduler.submit([second.seq])
    second.wait_tokens(2)
    third = Tracked("c", PROMPTS[2], seed=3, max_new_tokens=10, ignore_eos=True, **params)
    fourth = Tracked("d", PROMPTS[3], seed=4, max_new_tokens=30, ignore_eos=True, **params)
    scheduler.submit([third.seq, fourth.seq])
    seqs = [t.result() for t in (first, second, third, fourth)]

    assert scheduler.stats.joined_running_batch >= (1 if tight(scheduler) else 3)
    for seq in seqs:
        assert seq.finish is not None and seq.finish.type == "length"
        assert len(seq.output_ids) == seq.params.max_new_tokens
        expected = full_forward_logprobs(reference, seq, temperature)
        got = torch.tensor(seq.output_logprobs)
        assert torch.allclose(got, expected, atol=1e-4), (seq.rid, (got - expected).abs().max())


def test_a_burst_of_mixed_lengths_and_copies_is_prefilled_in_one_forward(
    runner: ModelRunner, reference
):
    """Four prompts of 2..64 tokens, three copies each (a request with n = 3), arriving
    together: one packed prefill of the four distinct prefixes (93 tokens, no padding), and
    every copy's logprobs still equal a fresh full forward of its own prompt + response."""
    sched = engine_scheduler(runner, max_running_requests=16)
    tracked = [
        Tracked(f"p{i}-{j}", prompt, seed=10 * i + j, max_new_tokens=8, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS)
        for j in range(3)
    ]
    sched._waiting.extend(t.seq for t in tracked)  # all present at the first step
    sched.start()
    try:
        seqs = [t.result() for t in tracked]
    finally:
        sched.stop()
    assert sched.stats.prefill_batches == 1
    for seq in seqs:
        expected = full_forward_logprobs(reference, seq)
        got = torch.tensor(seq.output_logprobs)
        assert torch.allclose(got, expected, atol=1e-4), (seq.rid, (got - expected).abs().max())
    copies = [[s.output_ids for s in seqs[3 * i : 3 * i + 3]] for i in range(len(PROMPTS))]
    assert any(len({tuple(c) for c in group}) > 1 for group in copies)  # copies sample apart


def test_batched_greedy_output_equals_the_request_run_alone(scheduler: Scheduler):
    (alone,) = run(scheduler, Tracked("alone", PROMPTS[0], max_new_tokens=20, temperature=0))
    others = [
        Tracked(f"o{i}", p, seed=i, max_new_tokens=40, ignore_eos=True)
        for i, p in enumerate(PROMPTS[1:])
    ]
    scheduler.submit([t.seq for t in others])
    others[0].wait_tokens(4)
    (batched,) = run(scheduler, Tracked("batched", PROMPTS[0], max_new_tokens=20, temperature=0))
    for t in others:
        t.result()
    assert batched.output_ids == alone.output_ids
    assert torch.allclose(
        torch.tensor(batched.output_logprobs), torch.tensor(alone.output_logprobs), atol=1e-5
    )


def test_a_seeded_request_is_reproducible_and_the_seed_matters(scheduler: Scheduler):
    def sample(seed: int) -> list[int]:
        (seq,) = run(scheduler, Tracked("s", PROMPTS[0], seed=seed, max_new_tokens=16))
        return seq.output_ids

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_max_running_requests_bounds_the_batch_and_the_rest_wait(runner: ModelRunner):
    sched = engine_scheduler(runner, max_running_requests=2)
    seen: list[int] = []
    sched.start()
    try:
        tracked = [Tracked(f"r{i}", PROMPTS[i % 4], max_new_tokens=6) for i in range(5)]
        for t in tracked:
            inner = t.seq.notify
            t.seq.notify = lambda s, inner=inner: (seen.append(len(sched._batch)), inner(s))
        sched.submit([t.seq for t in tracked])
        results = [t.result() for t in tracked]
    finally:
        sched.stop()
    assert max(seen) <= 2
    assert all(len(s.output_ids) == 6 for s in results)


def sampled(rid: str, prompt: list[int], **params) -> Tracked:
    """Seeded temperature-1 sampling: the random tiny model's greedy output repeats one
    token, sampling gives varied tokens, and the seed makes it reproducible."""
    return Tracked(rid, prompt, seed=11, **params)


def test_stop_token_ids_ignore_eos_and_length(scheduler: Scheduler, runner: ModelRunner):
    (free,) = run(scheduler, sampled("f", PROMPTS[0], max_new_tokens=24))
    stop_at = free.output_ids[6]
    first_hit = free.output_ids.index(stop_at)
    (stopped,) = run(
        scheduler, sampled("t", PROMPTS[0], max_new_tokens=24, stop_token_ids={stop_at})
    )
    assert stopped.finish.to_json() == {"type": "stop", "matched": stop_at}
    assert stopped.output_ids == free.output_ids[: first_hit + 1]
    assert output_text(runner.tokenizer, stopped) == runner.tokenizer.decode(
        free.output_ids[:first_hit], skip_special_tokens=True
    )

    ignoring = sampled("i", PROMPTS[0], max_new_tokens=24, stop_token_ids={stop_at})
    ignoring.seq.params = SamplingParams(
        max_new_tokens=24, stop_token_ids=frozenset({stop_at}), ignore_eos=True
    )
    (ignored,) = run(scheduler, ignoring)
    assert ignored.finish.to_json() == {"type": "length", "length": 24}
    assert ignored.output_ids == free.output_ids

    (zero,) = run(scheduler, Tracked("z", PROMPTS[0], max_new_tokens=0))
    assert zero.finish.to_json() == {"type": "length", "length": 0}
    assert zero.output_ids == []


def test_stop_strings_are_trimmed_unless_no_stop_trim(scheduler: Scheduler, runner: ModelRunner):
    (free,) = run(scheduler, sampled("f", PROMPTS[1], max_new_tokens=64))
    text = runner.tokenizer.decode(free.output_ids, skip_special_tokens=True)
    # An ASCII character: never part of a multi-byte sequence, so no partial decode of an
    # earlier prefix can contain it.
    cut, stop = next((i, c) for i, c in enumerate(text) if i >= 2 and c.isascii() and c.isalnum())
    (trimmed,) = run(scheduler, sampled("s", PROMPTS[1], max_new_tokens=64, stop=(stop,)))
    assert trimmed.finish.to_json() == {"type": "stop", "matched": stop}
    assert output_text(runner.tokenizer, trimmed) == text[:cut]
    assert trimmed.output_ids == free.output_ids[: len(trimmed.output_ids)]
    (kept,) = run(
        scheduler, sampled("k", PROMPTS[1], max_new_tokens=64, stop=(stop,), no_stop_trim=True)
    )
    assert output_text(runner.tokenizer, kept) == text[: cut + 1]


def test_abort_one_request_returns_its_partial_output(scheduler: Scheduler):
    long = Tracked("long", PROMPTS[0], max_new_tokens=500, ignore_eos=True)
    other = Tracked("other", PROMPTS[1], max_new_tokens=8, temperature=0)
    scheduler.submit([long.seq, other.seq])
    long.wait_tokens(3)
    assert scheduler.abort("long").result(10) == 1
    seq = long.result()
    assert seq.finish.type == "abort"
    assert 3 <= len(seq.output_ids) < 500
    assert len(seq.output_logprobs) == len(seq.output_ids)
    assert other.result().finish.type != "abort"


def test_a_row_is_no_longer_running_once_its_caller_is_answered(scheduler: Scheduler):
    """The caller hears of the finish inside the step, before the row leaves the batch;
    /get_server_info read at that moment must already count it out (a CI race)."""
    row = Tracked("row", PROMPTS[0], max_new_tokens=4, ignore_eos=True)
    seen: list[int] = []
    inner = row.seq.notify
    row.seq.notify = lambda s: (
        seen.append(scheduler.info()["num_running_reqs"]) if s.done else None,
        inner(s),
    )
    scheduler.submit([row.seq])
    assert len(row.result().output_ids) == 4
    assert seen == [0]


def test_pause_abort_then_queued_requests_wait_for_continue(scheduler: Scheduler):
    running = Tracked("run", PROMPTS[0], max_new_tokens=500, ignore_eos=True)
    scheduler.submit([running.seq])
    running.wait_tokens(2)
    assert scheduler.pause("abort").result(10) == 1
    assert running.result().finish.type == "abort"

    queued = Tracked("queued", PROMPTS[1], max_new_tokens=4)
    scheduler.submit([queued.seq])
    assert not queued.done.wait(0.5), "a request ran while the engine was paused"
    assert scheduler.info()["num_waiting_reqs"] == 1
    scheduler.resume().result(10)
    assert len(queued.result().output_ids) == 4


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_in_place_or_retract_then_continue_gives_the_unpaused_result(
    scheduler: Scheduler, reference, mode: str
):
    (plain,) = run(
        scheduler, Tracked("p", PROMPTS[2], max_new_tokens=30, temperature=0, ignore_eos=True)
    )
    paused = Tracked("q", PROMPTS[2], max_new_tokens=30, temperature=0, ignore_eos=True)
    partner = Tracked("r", PROMPTS[3], seed=5, max_new_tokens=30, ignore_eos=True)
    scheduler.submit([paused.seq, partner.seq])
    paused.wait_tokens(5)
    scheduler.pause(mode).result(10)
    n_at_pause = len(paused.seq.output_ids)
    assert not paused.done.wait(0.3)
    assert len(paused.seq.output_ids) == n_at_pause
    running = 1 if tight(scheduler) else 2  # the tight pool runs one of them at a time
    assert scheduler.info()["num_running_reqs"] == (running if mode == "in_place" else 0)
    scheduler.resume().result(10)
    seq = paused.result()
    assert seq.output_ids == plain.output_ids
    for s in (seq, partner.result()):
        expected = full_forward_logprobs(reference, s)
        assert torch.allclose(torch.tensor(s.output_logprobs), expected, atol=1e-4)


def test_requests_that_can_never_run_are_rejected_naming_the_input(scheduler: Scheduler):
    with pytest.raises(RequestError, match="input_ids"):
        scheduler.submit([Tracked("e", [], max_new_tokens=1).seq])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        scheduler.submit([Tracked("v", [1, 10**6], max_new_tokens=1).seq])
    with pytest.raises(RequestError, match="context length"):
        scheduler.submit([Tracked("c", [1] * 5000, max_new_tokens=1).seq])


def test_pool_tokens_follow_the_live_rows(runner: ModelRunner):
    """The pool holds each live row's tokens, the n copies' prompt once, and nothing after."""
    scheduler = engine_scheduler(runner, max_running_requests=8)
    scheduler.start()
    try:
        _follow_the_live_rows(scheduler)
    finally:
        scheduler.stop()


def _follow_the_live_rows(scheduler: Scheduler) -> None:
    used: list[int] = []
    short = Tracked("short", PROMPTS[1], max_new_tokens=30, ignore_eos=True)
    inner = short.seq.notify
    short.seq.notify = lambda s: (used.append(scheduler._batch.used_tokens), inner(s))
    scheduler.submit([short.seq])
    short.wait_tokens(2)
    copies = [Tracked(f"long{j}", PROMPTS[2], max_new_tokens=3, ignore_eos=True) for j in range(3)]
    run(scheduler, *copies)
    short.result()
    # The three copies shared their prompt's slots: one prompt, not three, was ever held.
    assert max(used) < 2 * len(PROMPTS[2]) + len(PROMPTS[1]) + 30, used
    assert max(used) >= len(PROMPTS[2])
    assert scheduler.call(lambda: scheduler._batch.used_tokens).result(10) == 0


def test_max_total_tokens_sizes_the_pool_and_admits_only_what_fits(runner: ModelRunner):
    sched = engine_scheduler(runner, max_running_requests=8, max_total_tokens=48)
    sizes: list[int] = []
    sched.start()
    try:
        tracked = [Tracked(f"t{i}", PROMPTS[1], max_new_tokens=20) for i in range(3)]
        for t in tracked:
            inner = t.seq.notify
            t.seq.notify = lambda s, inner=inner: (sizes.append(len(sched._batch)), inner(s))
        sched.submit([t.seq for t in tracked])
        assert all(len(t.result().output_ids) == 20 for t in tracked)
        with pytest.raises(RequestError, match="KV token pool holds 48"):
            sched.submit([Tracked("big", [1] * 48, max_new_tokens=1).seq])
        # Alone, a request grows to the context, which the flags cap at the pool's size.
        alone = Tracked("alone", PROMPTS[1], max_new_tokens=60, ignore_eos=True)
        sched.submit([alone.seq])
        assert alone.result().finish.type == "length"
        assert len(PROMPTS[1]) + len(alone.seq.output_ids) == 48
    finally:
        sched.stop()
    assert max(sizes) == 1  # a page of prompt + 2 of reserve each: a second would exceed 48
    # Alone in a full pool short of the context, a row ends saying why (never a silent
    # "length"): the second copy of a prompt decodes on pages of its own, past the rest of
    # the prompt's page, which the first copy took. On 96 tokens both are admitted (a page of
    # prompt, a page and 4 of reserve); once the first is done, the second has 1 + 5 pages.
    sched = engine_scheduler(runner, max_running_requests=8, max_total_tokens=96)
    sched.start()
    try:
        first = Tracked("first", PROMPTS[1], max_new_tokens=2, ignore_eos=True)
        second = Tracked("second", PROMPTS[1], max_new_tokens=100, ignore_eos=True)
        sched.submit([first.seq, second.seq])
        assert first.result().finish.type == "length"
        finish = second.result().finish
        assert finish.type == "abort" and "KV token pool (96 tokens) is full" in finish.message
        assert len(second.seq.output_ids) == 5 * PAGE + 1  # its 5 pages full, then one more
        assert len(PROMPTS[1]) + len(second.seq.output_ids) < sched.context_length == 96
    finally:
        sched.stop()


def test_abort_by_the_client_rid_reaches_all_n_copies(scheduler: Scheduler):
    copies = [
        Tracked(f"grp-{j}", PROMPTS[0], max_new_tokens=500, ignore_eos=True) for j in range(3)
    ]
    for t in copies:
        t.seq.request_rid = "grp"
    scheduler.submit([t.seq for t in copies])
    copies[0].wait_tokens(2)
    assert scheduler.abort("grp").result(10) == 3
    assert all(t.result().finish.type == "abort" for t in copies)


def test_rows_that_outgrow_a_full_pool_are_retracted_and_finish_unchanged(
    runner: ModelRunner, reference
):
    """A pool of 192 tokens never grows (a GPU's): two rows of 19 + 150 tokens are both
    admitted (19 + DECODE_RESERVE each fits, in pages) and then outgrow it. The newest is retracted
    to the queue, not cut short, and prefilled again (from its cached pages) once the other
    is done: both end at 150 tokens, greedy outputs equal to each run alone, logprobs equal to a full forward."""
    alone = engine_scheduler(runner, max_running_requests=8)
    alone.start()
    try:
        (solo,) = run(
            alone, Tracked("solo", PROMPTS[0], max_new_tokens=150, temperature=0, ignore_eos=True)
        )
    finally:
        alone.stop()
    sched = engine_scheduler(runner, max_running_requests=8, max_total_tokens=192)
    sched.start()
    try:
        pair = [
            Tracked(f"r{i}", PROMPTS[0], max_new_tokens=150, temperature=0, ignore_eos=True)
            for i in range(2)
        ]
        seqs = run(sched, *pair)
    finally:
        sched.stop()
    assert sched.stats.retracted >= 1
    assert sched._batch.cache.hits > 0  # the retracted row's pages came back from the cache
    for seq in seqs:
        assert seq.finish.type == "length" and seq.output_ids == solo.output_ids
        expected = full_forward_logprobs(reference, seq)
        assert torch.allclose(torch.tensor(seq.output_logprobs), expected, atol=1e-4)
