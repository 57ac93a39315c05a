"""millstream's /generate response parsers fed answers shaped as SGLang's tokenizer manager
writes them.

Each fixture (fixtures/generate_*.json) is one answer of SGLang 0.5.23's /generate, written
by hand after the code that builds it, which each file's `_source` names (the tokenizer
manager's meta_info, the scheduler's finish reasons, the weight-version spans). What SGLang's
own code can tell on a CPU is checked here, so a fixture cannot drift from SGLang:
  * every answer decodes with SGLang's JSON contract for /generate responses
    (`sglang.api.v1.api_types.GenerateResponse`, the schema its Rust and Python servers share);
  * every finish_reason is what SGLang's FINISH_* class writes (`to_json()`);
  * the weight_versions spans are what `compute_weight_version_spans` and
    `add_weight_versions_to_meta_info` make.
Then the parsers: the default rollout's `append_answer` (rollout/generate.py), the router
client's split of a batched answer (rollout/client.py), and Miles' `generate`
(compat/miles/sglang_rollout.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from millstream.common.retry import Backoff
from millstream.common.types import Sample, SampleStatus
from millstream.compat.miles import Sample as MilesSample
from millstream.compat.miles import install_miles_modules, make_args
from millstream.rollout.client import RouterClient
from millstream.rollout.generate import append_answer

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"generate_{name}.json").read_text())


def answers(name: str) -> list[dict[str, Any]]:
    response = fixture(name)["response"]
    return response if isinstance(response, list) else [response]


def finish_reasons() -> dict[str, list[dict[str, Any]]]:
    from sglang.srt.managers.schedule_batch import (
        FINISH_ABORT,
        FINISH_LENGTH,
        FINISH_MATCHED_STR,
        FINISH_MATCHED_TOKEN,
    )

    stop, aborted = FINISH_MATCHED_TOKEN(matched=2).to_json(), FINISH_ABORT().to_json()
    return {
        "stop": [stop],
        "length": [FINISH_LENGTH(length=4).to_json()],
        "abort_running": [aborted],
        # the tokenizer manager's own, for a request that never left the waiting queue
        "abort_waiting": [{"type": "abort", "message": "Abort in waiting queue"}],
        "weight_versions": [FINISH_MATCHED_STR(matched="\n").to_json()],
        "batch_n2": [stop, FINISH_LENGTH(length=2).to_json(), stop, aborted],
    }


NAMES = sorted(finish_reasons())


@pytest.mark.parametrize("name", NAMES)
def test_fixture_is_what_sglang_writes(name):
    from sglang.api.v1.api_types import GenerateResponse

    found = fixture(name)
    assert found["_source"] and all("sglang/srt/" in line for line in found["_source"])
    for answer in answers(name):
        decoded = GenerateResponse.from_json_value(answer)
        assert decoded.meta_info is not None
        assert decoded.meta_info.completion_tokens == len(answer["output_ids"])
    assert [a["meta_info"]["finish_reason"] for a in answers(name)] == finish_reasons()[name]


def test_weight_version_spans_are_sglangs():
    from sglang.srt.utils.weight_versions import (
        WeightVersionEvent,
        add_weight_versions_to_meta_info,
        compute_weight_version_spans,
    )

    spans = compute_weight_version_spans([WeightVersionEvent("3", 2)], "4", 3)
    meta: dict[str, Any] = {"weight_version": "3"}
    add_weight_versions_to_meta_info(meta, spans, num_output_tokens=3)
    (answer,) = answers("weight_versions")
    assert {k: answer["meta_info"][k] for k in meta} == meta


# name -> (tokens, logprobs, versions, status, text); fallback version 7 ("default" is no int)
PARSED = {
    "stop": ([21, 22, 2], [-0.25, -0.5, -0.125], [3, 3, 3], "COMPLETED", "ab</s>"),
    "length": ([31, 32, 33, 34], [-1.0, -1.5, -0.75, -2.0], [7] * 4, "TRUNCATED", "wxyz"),
    "abort_running": ([41, 42], [-0.5, -0.25], [3, 3], "ABORTED", "pq"),
    "abort_waiting": ([], [], [], "ABORTED", ""),
    "weight_versions": ([51, 52, 10], [-0.5, -0.5, -0.25], [3, 3, 4], "COMPLETED", "hi\n"),
}


@pytest.mark.parametrize("name", sorted(PARSED))
def test_append_answer_reads_sglangs_answer(name):
    tokens, logprobs, versions, status, text = PARSED[name]
    sample = Sample(group_id="g", index=0, prompt_token_ids=[11, 12, 13, 14])
    (answer,) = answers(name)
    finish = append_answer(sample, answer, fallback_version=7)
    assert finish == answer["meta_info"]["finish_reason"]["type"]
    assert list(sample.response_token_ids) == tokens
    assert list(sample.rollout_logprobs) == pytest.approx(logprobs)
    assert list(sample.weight_versions) == versions
    assert list(sample.loss_mask) == [1] * len(tokens)
    assert sample.status == SampleStatus.Value(f"SAMPLE_STATUS_{status}")
    assert sample.response_text == text


def test_a_resumed_sample_keeps_both_sides_of_the_sync():
    sample = Sample(group_id="g", index=0, prompt_token_ids=[11, 12, 13, 14])
    append_answer(sample, answers("abort_running")[0], fallback_version=7)
    append_answer(sample, answers("weight_versions")[0], fallback_version=7)
    assert list(sample.response_token_ids) == [41, 42, 51, 52, 10]
    assert list(sample.weight_versions) == [3, 3, 3, 3, 4]
    assert sample.status == SampleStatus.SAMPLE_STATUS_COMPLETED


def test_router_client_splits_a_batched_parallel_answer_prompt_by_prompt():
    """Two callers with n = 2 each in one batch: SGLang answers prompt by prompt, the copies
    of a prompt together (`_handle_batch_request`); each caller gets its two."""
    batch = fixture("batch_n2")

    def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["input_ids"] == batch["request"]["input_ids"]
        return httpx.Response(200, json=batch["response"])

    async def main() -> list[Any]:
        client = RouterClient(
            "http://router", max_concurrency=4, retry=Backoff(attempts=1),
            transport=httpx.MockTransport(engine),
        )  # fmt: skip
        try:
            calls = [
                client.generate(ids, params, rid.removesuffix("-a1"))
                for ids, params, rid in zip(*(batch["request"][k] for k in
                                              ("input_ids", "sampling_params", "rid")), strict=True)
            ]  # fmt: skip
            return list(await asyncio.gather(*calls))
        finally:
            await client.aclose()

    first, second = asyncio.run(main())
    assert [a["output_ids"] for a in first] == [[61, 2], [62, 63]]
    assert [a["output_ids"] for a in second] == [[64, 2], [65]]
    statuses = []
    for answer in [*first, *second]:
        sample = Sample(group_id="g", index=0)
        append_answer(sample, answer, fallback_version=0)
        statuses.append(SampleStatus.Name(sample.status).removeprefix("SAMPLE_STATUS_"))
    assert statuses == ["COMPLETED", "TRUNCATED", "COMPLETED", "ABORTED"]


@pytest.mark.parametrize(
    ("name", "status", "versions"),
    [("stop", "COMPLETED", ["3"]), ("length", "TRUNCATED", ["default"]),
     ("abort_running", "ABORTED", ["3"])],
)  # fmt: skip
def test_miles_generate_reads_sglangs_answer(tmp_path, name, status, versions):
    """Miles' generate (a --custom-generate-function-path's building block) on the same
    answers; SGLang's weight_version strings are kept as Miles keeps them."""
    from millstream.common.config import parse_run_config
    from millstream.compat.miles import http_utils
    from millstream.compat.miles.misc import SingletonMeta
    from tests.support.tiny_model import build_tokenizer

    install_miles_modules()
    from miles.rollout.sglang_rollout import GenerateState, generate

    (answer,) = answers(name)
    build_tokenizer(tmp_path)
    cfg = parse_run_config(["--run-id", "t", "--rollout-batch-size", "2",
                            "--hf-checkpoint", str(tmp_path)], mode="async")  # fmt: skip
    args = make_args(cfg)
    args = type(args)(args.to_dict() | {"sglang_router_ip": "r", "sglang_router_port": 1})

    async def main() -> MilesSample:
        http_utils._HTTP = httpx.AsyncClient(
            transport=httpx.MockTransport(lambda _r: httpx.Response(200, json=answer))
        )
        try:
            params = copy.deepcopy(GenerateState(args).sampling_params)
            return await generate(args, MilesSample(prompt="hi"), params)
        finally:
            await http_utils.aclose()

    SingletonMeta.clear_all_instances()
    try:
        sample = asyncio.run(main())
    finally:
        SingletonMeta.clear_all_instances()
    assert sample.status == getattr(MilesSample.Status, status)
    assert sample.tokens == [71, 72, *answer["output_ids"]]  # "hi" in the tiny tokenizer
    assert sample.rollout_log_probs == [p[0] for p in answer["meta_info"]["output_token_logprobs"]]
    assert sample.response == answer["text"] and sample.weight_versions == versions
