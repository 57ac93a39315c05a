"""From a /generate body to scheduler Sequences, and from Sequences back to SGLang's output.

Expansion (SGLang's order): a batch of P prompts with n samples each becomes P * n sequences,
grouped by prompt (index = i * n + j); the response is a list whenever the input is a batch
or n > 1, else one object. Copy j of a request seeded with `sampling_seed` s draws from a
`random.Random` seeded s + j: reproducible, yet the n samples of one prompt differ (GRPO needs
that). Requests without a seed get one from the engine RNG (--seed).

Output object: {text, output_ids, meta_info} with meta_info id, finish_reason (object or
null while streaming), prompt_tokens, completion_tokens, cached_tokens, weight_version,
e2e_latency and, with return_logprob, input_token_logprobs and output_token_logprobs, both
lists of [logprob, token_id, text] (text only with return_text_in_logprobs, else null, as
SGLang). Streaming sends the cumulative object so far as `data: {json}` server-sent events,
then `data: [DONE]`.

Input logprobs (SGLang's scheduler and output processor): `logprob_start_len` s (per prompt,
default -1) picks the prompt positions s .. L-1; -1 means L-1, so a plain return_logprob
request gets one entry. Entry k is [log P(prompt[s+k] | prompt[:s+k]), prompt[s+k], text],
except that entry 0 is always [null, prompt[s], text]: SGLang never scores the first returned
position, whatever s is (to score prompt[j], ask for s <= j - 1). An s outside [-1, L) is a
400 naming it; without return_logprob, s is ignored, as SGLang does. With n > 1 every copy
carries the same list (computed once). `max_new_tokens: 0` prefills, scores, and returns no
output tokens (finish_reason length 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..core import EngineCore
from ..sampling import SamplingParams
from ..scheduler import RequestError
from ..sequence import InputLogprobs, Sequence, output_text
from .protocol import GenerateReqIn, SamplingParamsIn


class Waiter:
    """Wakes one asyncio task when the scheduler thread changes one of its sequences: after
    every token while the task streams, only when a sequence finishes once it waits for the
    end (`finishes_only`). At most one wake-up is in flight: the scheduler thread writes to
    the event loop's self-pipe once per burst, not once per token of every sequence (a
    128-sequence job woke the loop 768 times for 6 tokens, and each wake-up checked every
    sequence, in the thread that serves HTTP)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        self._every_change = True
        self._pending = False

    def finishes_only(self) -> None:
        """From now on, wake only when a sequence finished (the caller waits for the end)."""
        self._every_change = False

    def __call__(self, seq: Sequence) -> None:
        if self._pending or not (self._every_change or seq.done):
            return
        self._pending = True
        # A closed loop raises RuntimeError: nobody waits for this request any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        # Cleared before the task runs: a change after this point schedules a new wake-up,
        # and a change before it is seen by the task woken here.
        self._pending = False
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


@dataclass
class Item:
    seq: Sequence
    return_logprob: bool


@dataclass
class Job:
    items: list[Item]
    waiter: Waiter
    as_list: bool
    text_in_logprobs: bool = False

    @property
    def done(self) -> bool:
        return all(item.seq.done for item in self.items)

    @property
    def seqs(self) -> list[Sequence]:
        return [item.seq for item in self.items]


def per_prompt(value: Any, count: int, name: str, default: Any) -> list[Any]:
    """A scalar applies to every prompt; a list must have one entry per prompt."""
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise RequestError(f"{name}: {len(value)} entries for {count} prompts")
    return value


def resolve_params(p: SamplingParamsIn, prompt_len: int, context_length: int) -> SamplingParams:
    room = max(context_length - prompt_len, 0)
    max_new = room if p.max_new_tokens is None else p.max_new_tokens
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        stop=p.stop_list,
        stop_token_ids=frozenset(p.stop_token_ids or ()),
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        no_stop_trim=p.no_stop_trim,
        sampling_seed=p.sampling_seed,
    )


def input_logprobs_for(prompt: list[int], start: int, where: str) -> InputLogprobs:
    """SGLang's resolution of logprob_start_len for a request with return_logprob."""
    length = len(prompt)
    if not prompt:  # rejected by Scheduler.validate ("the prompt is empty")
        return InputLogprobs(start=0, values=[])
    if start == -1:
        return InputLogprobs(start=length - 1, values=[None])
    if not 0 <= start < length:
        raise RequestError(
            f"logprob_start_len{where}: {start} is not a position of the {length}-token "
            f"prompt; use 0 .. {length - 1}, or -1 for output logprobs only"
        )
    # start == L - 1: the one entry is the unscored first one; nothing to compute.
    return InputLogprobs(start=start, values=[None] if start == length - 1 else None)


def make_job(
    core: EngineCore,
    prompts: list[list[int]],
    params: list[SamplingParamsIn],
    rids: list[str | None],
    return_logprob: list[bool],
    *,
    force_list: bool,
    logprob_start_len: list[int] | None = None,
) -> Job:
    waiter = Waiter()
    items: list[Item] = []
    starts = logprob_start_len or [-1] * len(prompts)
    for i, (prompt, p, rid, logprob, start) in enumerate(
        zip(prompts, params, rids, return_logprob, starts, strict=True)
    ):
        where = f"[{i}]" if force_list else ""
        if len(prompt) >= core.scheduler.context_length:  # SGLang's check, and its words
            raise RequestError(
                f"input{where}: the input ({len(prompt)} tokens) is longer than the model's "
                f"context length ({core.scheduler.context_length} tokens)"
            )
        resolved = resolve_params(p, len(prompt), core.scheduler.context_length)
        base = rid or uuid.uuid4().hex
        holder = input_logprobs_for(prompt, start, where) if logprob else None
        for j in range(p.n):
            seed = core.fresh_seed() if p.sampling_seed is None else p.sampling_seed + j
            seq = Sequence(
                rid=base if p.n == 1 else f"{base}-{j}",
                prompt_ids=list(prompt),
                params=resolved,
                rng=random.Random(seed),
                notify=waiter,
                request_rid=rid,
                input_logprobs=holder,
            )
            items.append(Item(seq, logprob))
    as_list = force_list or any(p.n > 1 for p in params)
    return Job(items, waiter, as_list)


def job_from_generate(core: EngineCore, req: GenerateReqIn) -> Job:
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        prompts = [core.tokenizer.encode(t) for t in texts]
    else:
        ids = req.input_ids or []
        prompts = ids if req.is_batch else [ids]  # type: ignore[list-item]
    count = len(prompts)
    params = per_prompt(req.sampling_params, count, "sampling_params", SamplingParamsIn())
    if isinstance(req.rid, str) and req.is_batch:
        rids: list[str | None] = [f"{req.rid}-{i}" for i in range(count)]
    else:
        rids = per_prompt(req.rid, count, "rid", None)
    logprob = per_prompt(req.return_logprob, count, "return_logprob", False)
    starts = per_prompt(req.logprob_start_len, count, "logprob_start_len", -1)
    job = make_job(
        core, prompts, params, rids, logprob, force_list=req.is_batch, logprob_start_len=starts
    )
    job.text_in_logprobs = req.return_text_in_logprobs
    return job


def output_of(core: EngineCore, item: Item, text_in_logprobs: bool) -> dict[str, Any]:
    seq = item.seq
    done = seq.done  # read before the lists: they are complete once finish is set
    n = len(seq.output_ids) if done else len(seq.output_logprobs)
    ids = seq.output_ids[:n]
    end = seq.finished_at if done and seq.finished_at is not None else time.perf_counter()
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish.to_json() if done and seq.finish else None,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": n,
        "cached_tokens": 0,
        "weight_version": seq.weight_version if done else core.weight_version,
        "e2e_latency": end - seq.created_at,
    }
    if item.return_logprob:

        def entries(logprobs: list[float | None], token_ids: list[int]) -> list[list[Any]]:
            decode = core.tokenizer.decode
            return [
                [lp, tid, decode([tid]) if text_in_logprobs else None]
                for lp, tid in zip(logprobs, token_ids, strict=True)
            ]

        holder = seq.input_logprobs
        meta["input_token_logprobs"] = (
            []  # not computed: the request ended (abort) before its prefill
            if holder is None or holder.values is None
            else entries(holder.values, seq.prompt_ids[holder.start :])
        )
        meta["output_token_logprobs"] = entries(list(seq.output_logprobs[:n]), ids)
    text = output_text(core.tokenizer, seq, None if done else n)
    return {"text": text, "output_ids": ids, "meta_info": meta}


def submit(core: EngineCore, job: Job) -> None:
    core.scheduler.submit(job.seqs)


def abort_unfinished(core: EngineCore, job: Job) -> None:
    for seq in job.seqs:
        if not seq.done:
            core.scheduler.abort(seq.rid)


async def wait_done(core: EngineCore, job: Job, receive: Any | None = None) -> None:
    """Wait until every sequence finished; abort them if the client goes away first.

    `receive` is the request's ASGI receive: after the body was read, its next message is
    `http.disconnect`, so a task awaiting it learns when the client hangs up."""
    job.waiter.finishes_only()
    watcher = asyncio.create_task(_watch_disconnect(core, job, receive)) if receive else None
    try:
        while not job.done:
            await job.waiter.wait()
    finally:
        if watcher is not None:
            watcher.cancel()


async def _watch_disconnect(core: EngineCore, job: Job, receive: Any) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            abort_unfinished(core, job)
            return


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def updates(core: EngineCore, job: Job) -> AsyncIterator[tuple[int, Item, bool]]:
    """(index, item, done) each time a sequence grew or finished, until all finished.
    Unfinished sequences are aborted when the consumer stops early (client gone)."""
    sent = [0] * len(job.items)
    closed = [False] * len(job.items)
    try:
        while True:
            for i, item in enumerate(job.items):
                if closed[i]:
                    continue
                done = item.seq.done
                count = len(item.seq.output_logprobs)
                if count > sent[i] or done:
                    sent[i], closed[i] = count, done
                    yield i, item, done
            if all(closed):
                return
            await job.waiter.wait()
    finally:
        abort_unfinished(core, job)


async def stream_outputs(core: EngineCore, job: Job) -> AsyncIterator[str]:
    """SGLang-style SSE: the cumulative output of a sequence each time it grew."""
    async for index, item, _ in updates(core, job):
        out = output_of(core, item, job.text_in_logprobs)
        if job.as_list:
            out["index"] = index
        yield sse(out)
    yield "data: [DONE]\n\n"
