"""A weight sync while SGLang generates, with each --pause-mode: a real rollout worker's sample
that spans the sync says, token by token, which weights made it.

The sample: the arith model asked "hello world" (no sum to answer: it writes digits to its
token budget, no early end), greedy, through millstream's router and a real rollout worker
process. SGLang's steps are slowed (its /slow_down, a test endpoint) so that the sync, the
trainer's own WeightSync (push.py) with new weights as version V and the mode under test, lands
after a few tokens:

  abort     SGLang ends the request with finish_reason abort and the tokens so far; with
            --partial-rollout the worker sends it again from them after the sync;
  in_place  the request stays in SGLang's running batch, paused, and goes on after the update
            on its old keys (SGLang needs no cache flush for it: the sync asks none);
  retract   SGLang moves it back to its queue and prefills it again after the update.

For every mode the sample's per-token versions are the old version up to a split, then V,
and the split is where the weights changed: the first token that is not the old weights'
greedy answer (a reference taken before), by its token or its log-prob. A version written
late (a new-weight token marked old) or early fails. One exception, SGLang's own: with
in_place its overlap scheduler may mark the last old token new (the test says why, and
prints when it happened).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import pytest

from millstream.common.config import parse_run_config
from millstream.common.keys import RunKeys
from millstream.common.types import PromptGroup, SampleGroup
from tests.sglang_live.server import ARITH_MODEL, LiveSglang
from tests.sglang_live.test_routes import Pusher
from tests.support.reward_proc import publish_config
from tests.support.rollout_proc import RolloutProcs, publish_prompts, read_stream

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 40  # the arith model's context is 64
STEP_S = 0.25  # SGLang's sleep a step while the sync is being aimed: 10 s for the answer
ATOL = 1e-4


def prompt_ids() -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ARITH_MODEL).encode("hello world")


def gate_at(router: str, version: str) -> None:
    """Gate the router on the server's version as it is now: an earlier test's trainer left
    it gated on the version that test pushed, and test_parity put the base weights back
    behind its back (straight to the server), so the rollout worker's request would wait
    for a version the server no longer has."""
    resp = httpx.post(f"{router}/set_weight_version", json={"weight_version": version}, timeout=30)
    resp.raise_for_status()
    assert resp.json()["eligible"], resp.text


def in_flight(router: str) -> int:
    workers = httpx.get(f"{router}/workers", timeout=5).json()["workers"]
    return sum(w["in_flight"] for w in workers)


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_a_sync_mid_generation_is_told_token_by_token(
    routed: str, sglang: LiveSglang, redis_url: str, tmp_path: Path, mode: str
):
    prompt = prompt_ids()
    old_version = sglang.version()
    gate_at(routed, old_version)
    (reference,) = sglang.greedy([prompt], MAX_NEW)
    ref_tokens = reference["output_ids"]
    ref_logprobs = [lp for lp, _, _ in reference["meta_info"]["output_token_logprobs"]]
    assert len(ref_tokens) == MAX_NEW  # no early end: room for the sync to land

    run_id = f"p{uuid.uuid4().hex[:8]}"
    flags = ["--run-id", run_id, "--router-url", routed, "--rollout-batch-size", "1",
             "--n-samples-per-prompt", "1", "--rollout-temperature", "0",
             "--rollout-max-response-len", str(MAX_NEW), "--stream-block-ms", "50"]  # fmt: skip
    if mode == "abort":
        flags.append("--partial-rollout")
    asyncio.run(publish_config(redis_url, parse_run_config(flags, mode="async")))
    procs = RolloutProcs(redis_url, run_id, tmp_path)
    version = 200 + ["abort", "in_place", "retract"].index(mode)
    try:
        procs.start("r1")
        procs.wait_ready("r1")
        httpx.post(f"{sglang.url}/slow_down", json={"forward_sleep_time": STEP_S}, timeout=10)
        publish_prompts(
            redis_url,
            RunKeys(run_id).prompts,
            [PromptGroup(group_id="g0", prompt_token_ids=prompt)],
        )
        with Pusher(routed, sglang, version, tmp_path, "--pause-mode", mode) as pusher:
            deadline = time.monotonic() + 60
            while in_flight(routed) == 0:
                assert time.monotonic() < deadline, procs.log("r1")
                time.sleep(0.05)
            time.sleep(8 * STEP_S)  # a few tokens at the old weights
            report = pusher.go()
        assert report["engines"] == [sglang.url], report
        httpx.post(f"{sglang.url}/slow_down", json={"forward_sleep_time": None}, timeout=10)
        ((group, _),) = read_stream(redis_url, RunKeys(run_id).generated, SampleGroup, 1, 90)
        assert procs.stop("r1") == 0
    finally:
        httpx.post(f"{sglang.url}/slow_down", json={"forward_sleep_time": None}, timeout=10)
        procs.stop_all()

    assert not group.failure_reason, group.failure_reason
    (sample,) = group.samples
    tokens, logprobs = list(sample.response_token_ids), list(sample.rollout_logprobs)
    versions = [str(v) for v in sample.weight_versions]
    print(f"\n{mode}: {len(tokens)} tokens, versions {versions}")
    assert len(tokens) == len(versions) == len(logprobs) == MAX_NEW
    split = versions.index(str(version))
    assert split > 0, "the sync landed before the first token: aim it later"
    assert versions == [old_version] * split + [str(version)] * (MAX_NEW - split)
    # Where the weights changed: the first token that is not the old weights' greedy answer
    # (its token, or its log-prob beyond the tolerance).
    changed = next(
        i
        for i in range(MAX_NEW)
        if tokens[i] != ref_tokens[i] or abs(logprobs[i] - ref_logprobs[i]) > ATOL
    )
    if mode == "in_place" and split == changed - 1:
        print(f"in_place: SGLang marked token {split} new; the old weights made it")
    if mode == "in_place":
        # SGLang 0.5.23 with its overlap scheduler (the default) counts a request's old tokens
        # when the update lands; an in-place pause leaves the step already run for the next
        # token in its result queue (scheduler.py `pause_generation`: "result_queue left
        # untouched"), so that token, made by the old weights, is appended after the count
        # and marked new: the split may come one token early. The sample's oldest version,
        # which staleness and admission read, is right either way.
        assert split in (changed - 1, changed), (split, changed)
    else:  # abort: the worker resumes from the tokens it got; retract: SGLang drains first
        assert split == changed, (split, changed)
    if mode == "abort":
        assert "resuming 1 partial group" in procs.log("r1")
