"""Rollout worker against a fake SGLang engine (httpx.MockTransport, no sockets): concurrent
samples under the worker-wide bound, partial rollout resume, regeneration, the abort bound,
the partial buffer's release rules, a user rollout function, and router errors."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider

from millstream.common import telemetry
from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.common.retry import Backoff
from millstream.common.types import PromptGroup, SampleGroup, SampleStatus
from millstream.compat import miles
from millstream.rollout.client import FRESH, RouterClient
from millstream.rollout.generate import append_answer, new_sample
from millstream.rollout.partial import PartialBuffer
from millstream.rollout.worker import RolloutWorker
from tests.support.rollout_plugins import USER_TURN_TEXT, drops_all, longest_first
from tests.support.rollout_proc import fake_answer, logprob_at, token_at

PROMPT = [11, 12, 13, 14]


class FakeEngine:
    """SGLang's /generate and the router's /get_weight_version, with scripted trouble.

    `aborts[rid_prefix] = k`: the next request whose rid starts with it is aborted after k
    tokens, and the served version moves on `bump_after_s` later (a weight sync);
    `abort_every = k`: every request is.
    `statuses`: HTTP status codes to answer the next requests with, before any generation.
    """

    def __init__(self, *, latency_s: float = 0.0, bump_after_s: float = 0.02):
        self.latency_s = latency_s
        self.bump_after_s = bump_after_s
        self.version = 1
        self.requests: list[dict] = []
        self.headers: list[httpx.Headers] = []
        self.aborts: dict[str, int] = {}
        self.abort_every: int | None = None  # every request aborted after this many tokens
        self.statuses: list[int] = []
        self.in_flight = self.max_in_flight = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": str(self.version)})
        body = json.loads(request.content)
        self.requests.append(body)
        self.headers.append(request.headers)
        if self.statuses:
            return httpx.Response(self.statuses.pop(0), text="scripted failure")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency_s)
            return httpx.Response(200, json=self.generate(body))
        finally:
            self.in_flight -= 1

    def generate(self, body: dict) -> dict | list[dict]:
        n = int(body["sampling_params"].get("n") or 1)
        if n == 1:
            return self._one(body.get("rid", "miles"), body)  # Miles' generate sends no rid
        # Parallel sampling: copy j stands for sample j, so scripted aborts still apply per sample.
        group = body["rid"].rsplit("-n", 1)[0]
        return [self._one(f"{group}-s{j}-r0-a1", body) for j in range(n)]

    def _one(self, rid: str, body: dict) -> dict:
        abort_after = self.abort_every
        if abort_after is not None:
            asyncio.get_running_loop().call_later(self.bump_after_s, self.bump)
        for prefix, k in list(self.aborts.items()):
            if rid.startswith(prefix):
                del self.aborts[prefix]
                abort_after = k
                asyncio.get_running_loop().call_later(self.bump_after_s, self.bump)
        return fake_answer(body, str(self.version), abort_after)

    def bump(self) -> None:
        self.version += 1


def prompt_group(group_id: str = "g1", **kw) -> PromptGroup:
    return PromptGroup(group_id=group_id, prompt_token_ids=PROMPT, admitted_version=1, **kw)


def run_worker(engine: FakeEngine, groups: list[PromptGroup], *flags: str, attempts: int = 3):
    """Roll out `groups` concurrently with a worker built from these run flags."""
    cfg = parse_run_config(
        ["--rollout-batch-size", "2", "--rollout-max-response-len", "8", *flags], mode="async"
    )

    async def main() -> list[SampleGroup]:
        client = RouterClient(
            "http://router",
            max_concurrency=cfg.rollout.rollout_max_concurrency,
            retry=Backoff(attempts=attempts, first_s=0.001),
            transport=engine.transport(),
            coalesce_window_s=None,  # one HTTP request per call: the flows are what is tested
        )
        redis = aioredis.Redis()  # never used: rollout() does not touch the streams
        worker = RolloutWorker(cfg, redis, client, "unit", partial_poll_s=0.01)
        releaser = asyncio.create_task(worker.buffer.run())
        miles.http_utils._HTTP = httpx.AsyncClient(transport=engine.transport())  # same engine
        try:
            return await asyncio.gather(*(worker.rollout(g) for g in groups))
        finally:
            releaser.cancel()
            await client.aclose()
            await redis.aclose()
            await miles.http_utils.aclose()

    return asyncio.run(main())


def expected_tokens(n: int = 8) -> list[int]:
    return [token_at(len(PROMPT) + i) for i in range(n)]


def test_samples_run_concurrently_under_the_worker_bound():
    engine = FakeEngine(latency_s=0.02)
    groups = [prompt_group(f"g{i}", data_index=i) for i in range(6)]
    groups.append(prompt_group("e0", is_eval=True, eval_name="dev"))
    results = run_worker(engine, groups, "--n-samples-per-prompt", "4",
                         "--rollout-max-concurrency", "5", "--n-samples-per-eval-prompt", "2",
                         "--eval-temperature", "0")  # fmt: skip
    assert engine.max_in_flight == 5
    assert [len(r.samples) for r in results] == [4] * 6 + [2]
    for result in results:
        assert not result.failure_reason and result.prompt.group_id
        for sample in result.samples:
            assert list(sample.response_token_ids) == expected_tokens()
            assert list(sample.weight_versions) == [1] * 8
            assert sample.status == SampleStatus.SAMPLE_STATUS_TRUNCATED
    # One request per group, carrying n (parallel sampling): the engine batches the copies.
    assert len({r["rid"] for r in engine.requests}) == len(engine.requests) == 7
    assert sorted(r["sampling_params"]["n"] for r in engine.requests) == [2] + [4] * 6
    assert all(r["return_logprob"] for r in engine.requests)
    seeds = {r["sampling_params"]["sampling_seed"] for r in engine.requests}
    assert len(seeds) == 7
    temps = [r["sampling_params"]["temperature"] for r in engine.requests if "e0" in r["rid"]]
    assert temps == [0]


def test_partial_rollout_resumes_from_the_partial_tokens():
    engine = FakeEngine()
    engine.aborts["g1-s0-"] = 3
    (result,) = run_worker(engine, [prompt_group(n_samples=1)], "--partial-rollout")
    (resumed,) = result.samples
    assert list(resumed.response_token_ids) == expected_tokens()
    assert list(resumed.rollout_logprobs) == pytest.approx([logprob_at(4 + i) for i in range(8)])
    # Released by the version change (nothing else answered meanwhile).
    assert list(resumed.weight_versions) == [1, 1, 1, 2, 2, 2, 2, 2]
    assert list(resumed.loss_mask) == [1] * 8
    assert resumed.status == SampleStatus.SAMPLE_STATUS_TRUNCATED
    second = next(r for r in engine.requests if r["rid"].startswith("g1-s0-r1"))
    assert second["input_ids"] == PROMPT + expected_tokens(3)
    assert second["sampling_params"]["max_new_tokens"] == 5
    assert json.loads(resumed.metadata_json)["rollout"] == {"requests": 2, "aborts": 1}


def test_offpolicy_prefix_is_masked_when_asked():
    engine = FakeEngine()
    engine.aborts["g1-s0-"] = 3
    (result,) = run_worker(engine, [prompt_group(n_samples=1)], "--partial-rollout",
                           "--mask-offpolicy-in-partial-rollout")  # fmt: skip
    assert list(result.samples[0].loss_mask) == [0, 0, 0, 1, 1, 1, 1, 1]


def test_without_partial_rollout_an_aborted_sample_starts_over():
    engine = FakeEngine()
    engine.aborts["g1-s0-"] = 3
    (result,) = run_worker(engine, [prompt_group(n_samples=1)])
    sample = result.samples[0]
    assert list(sample.response_token_ids) == expected_tokens()
    assert list(sample.weight_versions) == [2] * 8
    second = next(r for r in engine.requests if r["rid"].startswith("g1-s0-r1"))
    assert second["input_ids"] == PROMPT and second["sampling_params"]["max_new_tokens"] == 8


def test_a_sample_that_keeps_aborting_is_published_as_aborted():
    engine = FakeEngine(bump_after_s=0.0)
    for r in range(20):
        engine.aborts[f"g1-s0-r{r}-"] = 1
    (result,) = run_worker(engine, [prompt_group(n_samples=2)])
    aborted, fine = result.samples
    assert aborted.status == SampleStatus.SAMPLE_STATUS_ABORTED
    assert json.loads(aborted.metadata_json)["rollout"]["aborts"] == 9
    assert fine.status == SampleStatus.SAMPLE_STATUS_TRUNCATED


class _Versions:
    """The part of RouterClient the partial buffer uses."""

    def __init__(self) -> None:
        self.version: str | None = "1"

    async def get_weight_version(self) -> str | None:
        return self.version


def _parked_group(group_id: str, tokens: int) -> PromptGroup:
    group = prompt_group(group_id)
    sample = new_sample(group, 0)
    engine = FakeEngine()
    append_answer(sample, engine.generate({"input_ids": PROMPT, "rid": "x",
                                           "sampling_params": {"max_new_tokens": tokens}}),
                  fallback_version=1)  # fmt: skip
    group.partial_samples.append(sample)
    return group


@pytest.mark.parametrize(("buffer_filter", "first"), [(None, "short"), (longest_first, "long"),
                                                      (drops_all, "short")])  # fmt: skip
def test_partial_buffer_releases_on_a_new_version_in_filter_order(buffer_filter, first):
    async def main() -> dict[str, int]:
        versions = _Versions()
        kwargs = {"buffer_filter": buffer_filter} if buffer_filter else {}
        buffer = PartialBuffer(versions, max_wait_s=60, **kwargs)  # type: ignore[arg-type]
        groups = {"short": _parked_group("short", 2), "long": _parked_group("long", 6)}
        waits = {
            gid: asyncio.create_task(buffer.wait(gid, lambda g=g: g)) for gid, g in groups.items()
        }
        await asyncio.sleep(0.01)
        assert buffer.release_ready("1", time.monotonic()) == []  # same version: keep waiting
        assert len(buffer) == 2
        versions.version = "2"
        buffer.release_ready("2", time.monotonic())
        return {gid: await task for gid, task in waits.items()}

    priorities = asyncio.run(main())
    assert priorities[first] == 0 and sorted(priorities.values()) == [0, 1]
    assert max(priorities.values()) < FRESH


def test_partial_buffer_releases_when_engines_answer_or_after_max_wait():
    async def main() -> None:
        buffer = PartialBuffer(_Versions(), max_wait_s=60)  # type: ignore[arg-type]
        task = asyncio.create_task(buffer.wait("g", lambda: prompt_group("g")))
        await asyncio.sleep(0.01)
        assert buffer.release_ready(None, time.monotonic()) == []  # no version known: wait
        buffer.engines_answered()
        assert buffer.release_ready(None, time.monotonic()) == ["g"]
        await task
        task = asyncio.create_task(buffer.wait("h", lambda: prompt_group("h")))
        await asyncio.sleep(0.01)
        assert buffer.release_ready("1", time.monotonic() + 61) == ["h"]
        await task
        cancelled = asyncio.create_task(buffer.wait("c", lambda: prompt_group("c")))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert len(buffer) == 0

    asyncio.run(main())


def test_a_user_rollout_function_replaces_the_default():
    engine = FakeEngine()
    (result,) = run_worker(
        engine,
        [prompt_group(n_samples=2)],
        "--rollout-function-path",
        "tests.support.rollout_plugins.two_turn",
    )
    assert len(result.samples) == 2 and len(engine.requests) == 4
    sample = result.samples[0]
    first = expected_tokens(4)
    user = PROMPT[:3]
    assert list(sample.response_token_ids)[:7] == first + user
    assert list(sample.loss_mask) == [1] * 4 + [0] * 3 + [1] * 4
    assert USER_TURN_TEXT in sample.response_text
    second = next(r for r in engine.requests if r["rid"].startswith("g1-0-t1"))
    assert second["input_ids"] == PROMPT + first + user


def test_router_errors_are_retried_then_fail_the_group_with_the_reason():
    engine = FakeEngine()
    engine.statuses = [503, 500]
    (ok,) = run_worker(engine, [prompt_group(n_samples=1)])
    assert not ok.failure_reason and len(engine.requests) == 3

    engine = FakeEngine()
    engine.statuses = [500] * 10
    (failed,) = run_worker(engine, [prompt_group(n_samples=2)])
    assert "failed 3 times" in failed.failure_reason and "HTTP 500" in failed.failure_reason
    assert not failed.samples and failed.prompt.group_id == "g1"

    engine = FakeEngine()
    engine.statuses = [400]
    (rejected,) = run_worker(engine, [prompt_group(n_samples=1)])
    assert "rejected the request with HTTP 400" in rejected.failure_reason
    assert len(engine.requests) == 1


def test_a_group_without_prompt_tokens_fails_with_the_reason():
    engine = FakeEngine()
    (result,) = run_worker(engine, [PromptGroup(group_id="t", prompt_text="hi")])
    assert "no prompt_token_ids" in result.failure_reason and not engine.requests


def test_a_per_sample_generate_function_that_is_not_there_is_named_at_start():
    with pytest.raises(MillstreamError, match=r"--custom-generate-function-path 'x\.y\.z'"):
        run_worker(FakeEngine(), [], "--custom-generate-function-path", "x.y.z")


MILES_GENERATE = ("--custom-generate-function-path", "tests.support.miles_plugins.generate")


@pytest.mark.parametrize("partial", [True, False])
def test_a_miles_generate_aborted_by_a_sync_is_called_again_not_trained_on(partial):
    """Miles' generate maps finish_reason abort to Sample.Status.ABORTED: the group parks
    in the partial buffer like the default rollout's, then the function is called again,
    resuming the sample (masked, as asked) or from a fresh copy of it."""
    engine = FakeEngine()
    engine.aborts["miles"] = 3
    flags = ["--partial-rollout", "--mask-offpolicy-in-partial-rollout"] if partial else []
    (result,) = run_worker(engine, [prompt_group(n_samples=1)], *MILES_GENERATE, *flags)
    (sample,) = result.samples
    assert len(engine.requests) == 2 and sample.status == SampleStatus.SAMPLE_STATUS_TRUNCATED
    assert list(sample.response_token_ids) == expected_tokens()
    assert json.loads(sample.metadata_json)["generated_by"] == "miles generate"
    second = engine.requests[1]
    if partial:  # Miles' resume: the tokens so far in, what is left of the budget out
        assert second["input_ids"] == PROMPT + expected_tokens(3)
        assert second["sampling_params"]["max_new_tokens"] == 5
        assert list(sample.loss_mask) == [0, 0, 0, 1, 1, 1, 1, 1]
        assert list(sample.weight_versions) == [1, 2]  # one per call, as Miles' generate keeps
    else:
        assert second["input_ids"] == PROMPT and not len(sample.loss_mask)
        assert list(sample.weight_versions) == [2]


def test_a_miles_generate_that_keeps_aborting_is_published_as_aborted():
    engine = FakeEngine(bump_after_s=0.0)
    engine.abort_every = 1
    (result,) = run_worker(engine, [prompt_group(n_samples=1)], *MILES_GENERATE)
    (sample,) = result.samples
    assert sample.status == SampleStatus.SAMPLE_STATUS_ABORTED and len(engine.requests) == 9


def test_a_rollout_function_that_returns_the_wrong_type_fails_its_group_as_a_plugin_error():
    path = "tests.support.rollout_plugins.returns_the_prompt"
    (result,) = run_worker(FakeEngine(), [prompt_group()], "--rollout-function-path", path)
    assert result.failure_reason.startswith(
        f"rollout: --rollout-function-path {path} raised TypeError: the rollout function "
        "returned PromptGroup"
    )
    assert result.plugin_error.flag == "--rollout-function-path"


def test_a_group_carried_back_with_partial_samples_resumes_them():
    group = prompt_group(n_samples=2)
    for index, (count, finish) in enumerate(((3, "abort"), (8, "length"))):
        sample = new_sample(group, index)
        body = {"input_ids": PROMPT, "rid": "x", "sampling_params": {"max_new_tokens": 8}}
        append_answer(sample, fake_answer(body, "1", count if finish == "abort" else None),
                      fallback_version=1)  # fmt: skip
        group.partial_samples.append(sample)
    engine = FakeEngine()
    engine.version = 2
    (result,) = run_worker(engine, [group], "--partial-rollout")
    resumed, finished = result.samples
    assert list(resumed.response_token_ids) == expected_tokens()
    assert list(resumed.weight_versions) == [1] * 3 + [2] * 5
    assert list(finished.weight_versions) == [1] * 8  # kept as carried, not regenerated
    assert len(engine.requests) == 1 and not result.prompt.partial_samples


class BatchingEngine(FakeEngine):
    """The fake engine, also answering SGLang's batch form (lists of input_ids,
    sampling_params and rids): the flat list of answers, prompt by prompt."""

    def __init__(self, *, bad_prompt: list[int] | None = None, **kw):
        super().__init__(**kw)
        self.bad_prompt = bad_prompt

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts = (
            body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
        )
        if self.bad_prompt in prompts:
            self.requests.append(body)
            return httpx.Response(400, text="input_ids: scripted bad prompt")
        return await super().handle(request)

    def generate(self, body: dict) -> dict | list[dict]:
        if not isinstance(body["input_ids"][0], list):
            return super().generate(body)
        out: list[dict] = []
        for ids, params, rid in zip(
            body["input_ids"], body["sampling_params"], body["rid"], strict=True
        ):
            one = super().generate(
                {**body, "input_ids": ids, "sampling_params": params, "rid": rid}
            )
            out += one if isinstance(one, list) else [one]
        return out


def coalescing_calls(engine: BatchingEngine, prompts: list[list[int]], n: int):
    async def main():
        client = RouterClient(
            "http://router", max_concurrency=64,
            retry=Backoff(attempts=2, first_s=0.001), transport=engine.transport(),
        )  # fmt: skip
        try:
            params = {"max_new_tokens": 4, "n": n}
            return await asyncio.gather(
                *(client.generate(p, params, f"g{i}-n{n}") for i, p in enumerate(prompts)),
                return_exceptions=True,
            ), client.batches_sent
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("n", [1, 3])
def test_calls_of_one_moment_go_out_as_one_batch_and_each_gets_its_own_answer(n):
    engine = BatchingEngine()
    prompts = [[20] * (3 + i) for i in range(10)]  # lengths tell the answers apart
    answers, batches = coalescing_calls(engine, prompts, n)
    assert len(engine.requests) == 1 and batches == 1
    assert engine.requests[0]["input_ids"] == prompts
    for prompt, answer in zip(prompts, answers, strict=True):
        parts = answer if n > 1 else [answer]
        assert len(parts) == n
        for part in parts:  # the fake engine answers token_at(position) after the prompt
            assert part["output_ids"] == [token_at(len(prompt) + k) for k in range(4)]


def test_a_batch_names_every_group_it_serves():
    """The batch's X-Millstream-Groups names each caller's group and span (the router and
    engine link to them all), and its trace context is the first caller's trace."""
    tracer = TracerProvider().get_tracer("t")  # recording spans; the global provider is untouched
    engine = BatchingEngine()

    async def one(client: RouterClient, i: int):
        ids = {telemetry.GROUP_ID: f"g{i}"}
        with tracer.start_as_current_span("process", attributes=ids) as span:
            await client.generate([20, 21 + i], {"max_new_tokens": 2}, f"g{i}-n1")
            return span.get_span_context()

    async def main():
        client = RouterClient("http://router", max_concurrency=8, transport=engine.transport())
        try:
            return await asyncio.gather(*(one(client, i) for i in range(3)))
        finally:
            await client.aclose()

    contexts = asyncio.run(main())
    (headers,) = engine.headers
    attributes, links = telemetry.served_groups(headers)
    assert attributes == {telemetry.GROUP_IDS: ["g0", "g1", "g2"]}
    assert [link.context.span_id for link in links] == [c.span_id for c in contexts]
    assert headers["traceparent"].split("-")[1] == f"{contexts[0].trace_id:032x}"


def test_a_bad_prompt_in_a_batch_fails_alone():
    bad = [99, 98, 97]
    engine = BatchingEngine(bad_prompt=bad)
    prompts = [[20, 21, 22], bad, [30, 31, 32]]
    answers, _ = coalescing_calls(engine, prompts, 1)
    assert isinstance(answers[1], MillstreamError) and "scripted bad prompt" in str(answers[1])
    assert all(isinstance(a, dict) and "meta_info" in a for a in (answers[0], answers[2]))
    assert len(engine.requests) == 4  # the batch, then one request each


def test_a_failing_batch_is_retried_by_each_member():
    engine = BatchingEngine()
    engine.statuses = [503]
    answers, _ = coalescing_calls(engine, [[20, 21], [22, 23]], 1)
    assert all(isinstance(a, dict) and "meta_info" in a for a in answers)
