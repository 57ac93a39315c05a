"""SGLang input logprobs over HTTP: how the trainer scores a finished prompt + response with a
teacher (on-policy distillation). `return_logprob` with `logprob_start_len` s returns
meta_info.input_token_logprobs for prompt positions s .. L-1 as [logprob, token_id, text];
entry 0 is always null (SGLang's output processor pads it), entry k >= 1 is
log P(ids[s+k] | ids[:s+k]) = log_softmax(logits / T) at position s+k-1, T = 1 when greedy.

The reference is an independent float64 full forward of transformers' AutoModelForCausalLM
over the same ids; the engine (float32, KV-cached prefill keeping only the asked positions)
must agree within 1e-4.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.engine_proc import EngineProcess, engine_fixtures

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# A "finished rollout": prompt bytes followed by response bytes, scored as one sequence.
SEQUENCE = list(b"<|im_start|>user\nWhat is 2+3?\n<|im_start|>assistant\nIt is 5, I think.")
OTHER = list(b"The quick brown fox jumps over the lazy dog")
ATOL = 1e-4


engine, client = engine_fixtures("--seed", "5", devices=("cpu", "sim-cuda"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    return model.to(torch.float64).eval()


def post(client: httpx.Client, body: Any, engine: EngineProcess) -> Any:
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, f"{resp.status_code} {resp.text}\n{engine.log_tail()}"
    return resp.json()


def reference_logprobs(model, ids: list[int], temperature: float = 1.0) -> list[float]:
    """ref[j] = log P(ids[j] | ids[:j]) for j >= 1 (ref[0] is NaN: nothing predicts it)."""
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([ids])).logits[0].double()
    logp_TV = torch.log_softmax(logits_TV / temperature, dim=-1)
    scored = logp_TV[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [float("nan"), *scored.tolist()]


def check_input_logprobs(
    entries: list[list[Any]], ids: list[int], start: int, ref: list[float]
) -> None:
    assert len(entries) == len(ids) - start
    assert [tid for _, tid, _ in entries] == ids[start:]
    assert entries[0][0] is None, "SGLang's first input logprob entry is null"
    assert_close([lp for lp, _, _ in entries[1:]], ref[start + 1 :])


def assert_close(got: list[float], want: list[float]) -> None:
    got_T = torch.tensor(got, dtype=torch.float64)
    want_T = torch.tensor(want, dtype=torch.float64)
    assert got_T.shape == want_T.shape
    assert torch.allclose(got_T, want_T, atol=ATOL, rtol=0), (got_T - want_T).abs().max()


@pytest.mark.parametrize("start", [0, 1, 23, len(SEQUENCE) - 2])
def test_prefill_only_scoring_matches_a_float64_full_forward(
    client: httpx.Client, engine: EngineProcess, reference, start: int
):
    body = {
        "input_ids": SEQUENCE,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": start,
    }
    out = post(client, body, engine)
    meta = out["meta_info"]
    check_input_logprobs(
        meta["input_token_logprobs"], SEQUENCE, start, reference_logprobs(reference, SEQUENCE)
    )
    # max_new_tokens 0: no new tokens, only the input logprobs (SGLang's prefill-only shape).
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["output_token_logprobs"] == []
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == len(SEQUENCE)
    assert meta["finish_reason"] == {"type": "length", "length": 0}


def test_scoring_a_response_starts_one_before_it(
    client: httpx.Client, engine: EngineProcess, reference
):
    """The distillation idiom that works on SGLang too: to score every response token,
    ask from prompt_len - 1 and drop the null first entry."""
    prompt_len = 30
    body = {
        "input_ids": [SEQUENCE, SEQUENCE],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": [prompt_len - 1, prompt_len],
    }
    one_before, at_prompt = post(client, body, engine)
    ref = reference_logprobs(reference, SEQUENCE)
    scored = [lp for lp, _, _ in one_before["meta_info"]["input_token_logprobs"][1:]]
    assert len(scored) == len(SEQUENCE) - prompt_len
    assert_close(scored, ref[prompt_len:])
    # Starting at prompt_len leaves the first response token unscored (null), as SGLang.
    assert at_prompt["meta_info"]["input_token_logprobs"][0] == [None, SEQUENCE[prompt_len], None]
    assert len(at_prompt["meta_info"]["input_token_logprobs"]) == len(SEQUENCE) - prompt_len


def test_input_logprobs_use_the_output_logprob_temperature(
    client: httpx.Client, engine: EngineProcess, reference, tiny_model_dir: Path
):
    """log_softmax(logits / T) like output_token_logprobs; greedy counts as T = 1."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    for temperature, ref_t in ((0.5, 0.5), (1.7, 1.7), (0.0, 1.0)):
        body = {
            "input_ids": OTHER,
            "sampling_params": {
                "max_new_tokens": 4,
                "temperature": temperature,
                "ignore_eos": True,
            },
            "return_logprob": True,
            "logprob_start_len": 5,
            "return_text_in_logprobs": True,
        }
        out = post(client, body, engine)
        entries = out["meta_info"]["input_token_logprobs"]
        check_input_logprobs(entries, OTHER, 5, reference_logprobs(reference, OTHER, ref_t))
        assert [text for _, _, text in entries] == [tokenizer.decode([t]) for t in OTHER[5:]]
        # The request still generates: its output logprobs follow on from the input ones.
        full = OTHER + out["output_ids"]
        assert len(out["output_ids"]) == 4
        expected = reference_logprobs(reference, full, ref_t)[len(OTHER) :]
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert_close(got, expected)


def test_batched_request_returns_one_list_per_item(
    client: httpx.Client, engine: EngineProcess, reference
):
    prompts = [SEQUENCE, OTHER, SEQUENCE[:9]]
    starts = [0, 7, 3]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": starts,
    }
    outs = post(client, body, engine)
    assert isinstance(outs, list) and len(outs) == 3
    for out, ids, start in zip(outs, prompts, starts, strict=True):
        check_input_logprobs(
            out["meta_info"]["input_token_logprobs"], ids, start, reference_logprobs(reference, ids)
        )
        assert out["output_ids"] == []

    # One scalar start applies to every prompt, as SGLang normalises it.
    outs = post(client, {**body, "logprob_start_len": 2}, engine)
    for out, ids in zip(outs, prompts, strict=True):
        check_input_logprobs(
            out["meta_info"]["input_token_logprobs"], ids, 2, reference_logprobs(reference, ids)
        )


def test_default_start_and_n_copies(client: httpx.Client, engine: EngineProcess, reference):
    # -1 (the default): SGLang's logprob_start_len = L - 1, one null entry for the last token.
    body = {"input_ids": OTHER, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    out = post(client, body, engine)
    assert out["meta_info"]["input_token_logprobs"] == [[None, OTHER[-1], None]]
    assert len(out["meta_info"]["output_token_logprobs"]) == 3
    zero = post(client, {**body, "sampling_params": {"max_new_tokens": 0}}, engine)
    assert zero["meta_info"]["input_token_logprobs"] == [[None, OTHER[-1], None]]
    assert zero["output_ids"] == []
    # Without return_logprob there are no logprob fields, and the start is not checked.
    plain = post(client, {"input_ids": OTHER, "logprob_start_len": 999}, engine)
    assert "input_token_logprobs" not in plain["meta_info"]

    # n > 1: as SGLang, every copy carries the same input logprobs.
    body = {
        "input_ids": OTHER,
        "sampling_params": {"max_new_tokens": 5, "n": 3, "sampling_seed": 2},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    outs = post(client, body, engine)
    assert len(outs) == 3
    ref = reference_logprobs(reference, OTHER)
    for out in outs:
        check_input_logprobs(out["meta_info"]["input_token_logprobs"], OTHER, 0, ref)
        assert len(out["output_ids"]) <= 5
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "n samples must differ"


def test_scoring_joins_a_decoding_batch_without_disturbing_it(
    client: httpx.Client, engine: EngineProcess, reference
):
    """A scoring request prefilled while another sequence decodes (continuous batching):
    both results still match a full forward. The simulated GPU decodes ~10x slower than the
    CPU: fewer tokens overlap the scoring there as surely."""
    new_tokens = 200 if engine.simulated_cuda else 600
    long_body = {
        "input_ids": list(b"Once upon a time"),
        "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0},
        "return_logprob": True,
    }
    score_body = {
        "input_ids": SEQUENCE,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    joined_before = client.get("/get_server_info").json()["scheduler"]["joined_running_batch"]
    with ThreadPoolExecutor(2) as pool:
        long_future = pool.submit(post, client, long_body, engine)
        while client.get("/get_server_info").json()["scheduler"]["num_running_reqs"] < 1:
            assert not long_future.done(), "the long request finished before scoring started"
            time.sleep(0.005)
        scored = post(client, score_body, engine)
        assert not long_future.done(), "scoring did not overlap the decoding request"
        long_out = long_future.result(60)
    # The scoring row was prefilled while the batch decoded; it left at once (no new tokens).
    info = client.get("/get_server_info").json()["scheduler"]
    assert info["joined_running_batch"] == joined_before
    assert info["num_running_reqs"] == 0
    check_input_logprobs(
        scored["meta_info"]["input_token_logprobs"],
        SEQUENCE,
        0,
        reference_logprobs(reference, SEQUENCE),
    )
    prompt = long_body["input_ids"]
    full = prompt + long_out["output_ids"]
    expected = reference_logprobs(reference, full)[len(prompt) :]
    got = [lp for lp, _, _ in long_out["meta_info"]["output_token_logprobs"]]
    assert len(got) == new_tokens
    assert_close(got, expected)


def test_streaming_carries_the_input_logprobs(
    client: httpx.Client, engine: EngineProcess, reference
):
    body = {
        "input_ids": OTHER,
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 4,
        "stream": True,
    }
    chunks = []
    with client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    assert chunks
    ref = reference_logprobs(reference, OTHER)
    for chunk in chunks:
        check_input_logprobs(chunk["meta_info"]["input_token_logprobs"], OTHER, 4, ref)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input_ids": OTHER, "logprob_start_len": len(OTHER)}, f"logprob_start_len: {len(OTHER)}"),
        ({"input_ids": OTHER, "logprob_start_len": 10**6}, "logprob_start_len"),
        ({"input_ids": OTHER, "logprob_start_len": -2}, "logprob_start_len: -2"),
        ({"input_ids": [OTHER, [1, 2]], "logprob_start_len": [0, 2]}, "logprob_start_len[1]"),
        ({"input_ids": [OTHER, [1, 2]], "logprob_start_len": [0]}, "logprob_start_len"),
        ({"text": "ab", "logprob_start_len": 2}, "2-token prompt"),
    ],
)
def test_a_bad_logprob_start_len_is_a_400_naming_it(
    client: httpx.Client, engine: EngineProcess, body: dict[str, Any], needle: str
):
    resp = client.post(
        "/generate",
        json={"return_logprob": True, "sampling_params": {"max_new_tokens": 0}, **body},
    )
    assert resp.status_code == 400, resp.text
    message = resp.json()["message"]
    assert needle in message, message
    # The engine is still serving after the rejection.
    ok = post(client, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}, engine)
    assert len(ok["output_ids"]) == 1
