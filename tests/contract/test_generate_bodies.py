"""The rollout workers' /generate bodies, judged by SGLang's own request handling.

`generate_problems` walks a body through every step SGLang 0.5.23 takes before the scheduler
sees it: FastAPI's validation into the `GenerateReqInput` dataclass (pydantic), no top-level
field the dataclass lacks (FastAPI would drop it silently), the JSON contract gate
`generate_contract_error` (sglang/srt/entrypoints/api_contract.py: it refuses sampling
params SGLang does not know), `normalize_batch_and_arguments()`, and for each request the
tokenizer manager's `SamplingParams(**params)`, `normalize` and `verify`.

The bodies come from the real senders, the engine replaced by `SGLangJudge`, an httpx
transport that judges each body, answers one SGLang would refuse with 400 and any other with
fixtures (fixtures/, one answer per request after normalization): the router client alone
and batched, the default rollout (a group's parallel first round and a partial rollout's
resume after an abort), and Miles' `generate`, fresh and continuing.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from millstream.common.config import parse_run_config
from millstream.common.retry import Backoff
from millstream.common.types import PromptGroup
from millstream.compat.miles import Sample as MilesSample
from millstream.compat.miles import install_miles_modules, make_args
from millstream.rollout.client import RouterClient
from millstream.rollout.group import DefaultRollout
from millstream.rollout.partial import PartialBuffer
from tests.contract.sglang_server import unknown_fields, validation_problems

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = [11, 12, 13, 14]


def generate_problems(body: Any, tokenizer: Any) -> tuple[Any, list[str]]:
    """(the normalized GenerateReqInput, []) when SGLang's /generate takes `body`, else (what
    got built, or None, and why not). `tokenizer`: the server's (stop strings need one)."""
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    try:
        obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
    except pydantic.ValidationError as err:
        return None, validation_problems(err)
    unknown = unknown_fields(GenerateReqInput, body)
    if unknown:
        return obj, [f"unknown field(s) {unknown}: GenerateReqInput drops them"]
    if (contract := generate_contract_error(body)) is not None:
        return obj, [f"SGLang's /generate contract: {contract}"]
    try:
        obj.normalize_batch_and_arguments()
        params = obj.sampling_params
        for one in [params] if isinstance(params, dict) else params:
            sampling = SamplingParams(**one)
            sampling.normalize(tokenizer)
            sampling.verify(len(tokenizer))
    except (ValueError, TypeError) as err:
        return obj, [f"{type(err).__name__}: {err}"]
    return obj, []


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"generate_{name}.json").read_text())


class SGLangJudge:
    """/generate judged by `generate_problems`; `script`: the fixtures that answer, in order,
    one per request after normalization (a body with n = 2 takes two). GET
    /get_weight_version answers for the router (the partial buffer asks it)."""

    def __init__(self, tokenizer: Any, *script: str):
        self.tokenizer = tokenizer
        self.script = list(script)
        self.judged: list[tuple[dict[str, Any], Any, list[str]]] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_weight_version":
            return httpx.Response(200, json={"weight_version": str(len(self.judged))})
        body = json.loads(request.content)
        obj, problems = generate_problems(copy.deepcopy(body), self.tokenizer)
        self.judged.append((body, obj, problems))
        if problems:  # SGLang's _create_error_response shape
            return httpx.Response(400, json={"error": {"message": "; ".join(problems)}})
        count = 1 if obj.is_single else obj.batch_size * obj.parallel_sample_num
        out = [fixture(self.script.pop(0))["response"] for _ in range(count)]
        return httpx.Response(200, json=out[0] if obj.is_single else out)

    def passed(self) -> list[Any]:
        """The normalized requests, once every body passed."""
        assert self.judged and all(not p for _, _, p in self.judged), self.judged
        return [obj for _, obj, _ in self.judged]


def with_client(judge: SGLangJudge, go: Callable[[RouterClient], Awaitable[Any]], **kw) -> Any:
    async def main() -> Any:
        client = RouterClient("http://router", max_concurrency=8, retry=Backoff(attempts=1),
                              transport=judge.transport(), **kw)  # fmt: skip
        try:
            return await go(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's byte-level tokenizer ("hi" -> [71, 72])."""
    from tests.support.tiny_model import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def run_config(*flags: str) -> Any:
    return parse_run_config(["--run-id", "t", "--rollout-batch-size", "2", *flags], mode="async")


@pytest.mark.parametrize("name", ["stop", "length", "abort_running", "abort_waiting",
                                  "weight_versions", "batch_n2"])  # fmt: skip
def test_each_fixtures_request_passes(name, tokenizer):
    assert generate_problems(fixture(name)["request"], tokenizer)[1] == []


def test_router_client_single_body(tokenizer):
    params = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.0,
              "skip_special_tokens": False, "no_stop_trim": True, "stop": ["</s>"],
              "stop_token_ids": [2], "sampling_seed": 12345}  # fmt: skip
    judge = SGLangJudge(tokenizer, "stop")
    with_client(judge, lambda c: c.generate(PROMPT, params, "g1-s0-r0"), coalesce_window_s=None)
    (obj,) = judge.passed()
    assert obj.is_single and obj.input_ids == PROMPT and obj.rid == "g1-s0-r0-a1"
    assert (obj.return_logprob, obj.logprob_start_len, obj.top_logprobs_num) == (True, -1, 0)
    assert obj.sampling_params == params


def test_router_client_batches_concurrent_calls_as_sglang_takes_them(tokenizer):
    params = {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 1}
    judge = SGLangJudge(tokenizer, "stop", "length")

    async def two(client: RouterClient) -> list[Any]:
        calls = [client.generate(PROMPT[:k], {**params, "sampling_seed": k}, f"g{k}")
                 for k in (2, 3)]  # fmt: skip
        return list(await asyncio.gather(*calls))

    first, second = with_client(judge, two)
    (obj,) = judge.passed()
    assert not obj.is_single and obj.batch_size == 2
    assert obj.input_ids == [PROMPT[:2], PROMPT[:3]] and obj.rid == ["g2-a1", "g3-a1"]
    assert [p["sampling_seed"] for p in obj.sampling_params] == [2, 3]
    assert obj.return_logprob == [True, True]
    assert first["output_ids"] == [21, 22, 2] and second["output_ids"] == [31, 32, 33, 34]


def test_default_rollout_first_round_and_partial_resume_bodies(tokenizer):
    """A group of 2: one request with n = 2; copy 0 is aborted by a sync after 2 tokens and
    resumes from its tokens with what is left of the budget (--partial-rollout)."""
    cfg = run_config(
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--rollout-temperature", "0.7", "--rollout-top-p", "0.9", "--rollout-top-k", "20",
        "--rollout-stop", "</s>", "--rollout-stop-token-ids", "2", "--partial-rollout",
    )  # fmt: skip
    group = PromptGroup(group_id="g1", prompt_token_ids=PROMPT, admitted_version=3)
    judge = SGLangJudge(tokenizer, "abort_running", "stop", "length")

    async def rollout(client: RouterClient) -> Any:
        buffer = PartialBuffer(client, poll_s=0.01, max_wait_s=0.05)
        releaser = asyncio.create_task(buffer.run())
        try:
            return await DefaultRollout(buffer, partial=True, mask_offpolicy=False)(
                group, cfg, client
            )
        finally:
            releaser.cancel()

    result = with_client(judge, rollout)
    first, resume = judge.passed()
    assert first.parallel_sample_num == 2 and first.input_ids == [PROMPT, PROMPT]
    sent = judge.judged[0][0]
    assert first.rid == [f"{sent['rid']}_0", f"{sent['rid']}_1"]  # SGLang's per-copy rids
    for params in first.sampling_params:
        assert {k: params[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k",
                                       "stop", "stop_token_ids", "no_stop_trim",
                                       "skip_special_tokens", "n")} == {
            "max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
            "stop": ["</s>"], "stop_token_ids": [2], "no_stop_trim": True,
            "skip_special_tokens": False, "n": 2,
        }  # fmt: skip
    assert resume.is_single and resume.input_ids == [*PROMPT, 41, 42]
    assert resume.sampling_params["max_new_tokens"] == 6 and resume.rid == "g1-s0-r1-a1"
    resumed = result.samples[0]
    assert list(resumed.response_token_ids) == [41, 42, 31, 32, 33, 34]
    assert list(result.samples[1].response_token_ids) == [21, 22, 2]


def test_miles_generate_bodies_fresh_and_continuing(tokenizer, tokenizer_dir):
    from millstream.compat.miles import http_utils
    from millstream.compat.miles.misc import SingletonMeta

    install_miles_modules()
    from miles.rollout.sglang_rollout import GenerateState, generate

    args = make_args(run_config("--hf-checkpoint", str(tokenizer_dir), "--rollout-stop", "</s>"))
    args = type(args)(args.to_dict() | {"sglang_router_ip": "r", "sglang_router_port": 1})
    judge = SGLangJudge(tokenizer, "stop", "length")

    async def main() -> None:
        http_utils._HTTP = httpx.AsyncClient(transport=judge.transport())
        try:
            params = GenerateState(args).sampling_params
            await generate(args, MilesSample(prompt="hi"), copy.deepcopy(params))
            going = MilesSample(prompt="hi", tokens=[71, 72, 5], response="e", response_length=1,
                                status=MilesSample.Status.ABORTED)  # fmt: skip
            await generate(args, going, copy.deepcopy(params))
        finally:
            await http_utils.aclose()

    SingletonMeta.clear_all_instances()
    try:
        asyncio.run(main())
    finally:
        SingletonMeta.clear_all_instances()
    fresh, going = judge.passed()
    assert fresh.input_ids == [71, 72] and going.input_ids == [71, 72, 5]
    budget = fresh.sampling_params["max_new_tokens"]
    assert going.sampling_params["max_new_tokens"] == budget - 1
    assert fresh.sampling_params["stop"] == ["</s>"] and fresh.return_logprob is True


# Bodies SGLang refuses, each with what generate_problems says: the check can fail.
REFUSED = [
    ({"input_ids": PROMPT, "sampling_params": {"max_tokens": 4}}, "max_tokens"),
    ({"input_id": PROMPT}, "unknown field(s) ['input_id']"),
    ({"input_ids": "11 12"}, "input_ids"),
    ({"input_ids": [PROMPT, PROMPT], "sampling_params": [{"n": 2}, {"n": 1}]},
     "parallel_sample_num should be the same"),
    ({"input_ids": [PROMPT, PROMPT], "rid": ["only-one"]}, "rids length mismatch"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": -1.0}}, "temperature"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "why"), REFUSED, ids=[w for _, w in REFUSED])
def test_what_sglang_refuses_is_refused(body, why, tokenizer):
    problems = generate_problems(body, tokenizer)[1]
    assert any(why in p for p in problems), problems
