"""A real engine process on loopback, driven over HTTP the way rollout workers and the
trainer's coordinator drive SGLang: /generate, control endpoints, OpenAI endpoints, errors."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.engine_proc import EngineProcess, engine_fixtures

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# As long as the context allows (1024 - prompt): a request the tests abort or pause must
# still be running when the call lands, even on a fast, idle machine.
LONG = {"max_new_tokens": 1000, "ignore_eos": True}


engine, client = engine_fixtures("--seed", "3")


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as p:
        yield p


def post(client: httpx.Client, path: str, body: Any, engine: EngineProcess | None = None) -> Any:
    resp = client.post(path, json=body)
    tail = engine.log_tail() if engine else ""
    assert resp.status_code == 200, f"{path} -> {resp.status_code} {resp.text}\n{tail}"
    return resp.json()


def info(client: httpx.Client) -> dict[str, Any]:
    return client.get("/get_server_info").json()["scheduler"]


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def pause_while_running(
    client: httpx.Client, pool: ThreadPoolExecutor, body: dict[str, Any], mode: str
) -> Future:
    """Submit `body` and pause (`mode`) once it runs. A request that wins the race and
    finishes before the pause lands (about 0.75 s for LONG on an idle machine; a loaded one
    can stall the test that long) is tried again, twice at most."""
    for _ in range(3):
        running = pool.submit(post, client, "/generate", body)
        wait_for(lambda: info(client)["num_running_reqs"] == 1)
        paused = post(client, "/pause_generation", {"mode": mode})
        caught = (
            paused["num_paused_requests"] == 1
            if mode == "abort"
            else info(client)["num_running_reqs"] == 1
        )
        if caught:
            return running
        post(client, "/continue_generation", {})
        running.result(60)
    raise AssertionError(f"the request finished before each of 3 pauses ({mode})")


def logprobs_of(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def full_forward_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([prompt + output])).logits[0]
    logp_TV = torch.log_softmax(logits_TV, dim=-1)[len(prompt) - 1 : -1]
    return logp_TV.gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_concurrent_requests_join_the_running_batch_and_logprobs_match_a_full_forward(
    client: httpx.Client, engine: EngineProcess, pool: ThreadPoolExecutor, reference
):
    joined_before = info(client)["joined_running_batch"]
    prompts = [list(b"Once upon a time"), list(b"Hi"), list(b"x" * 40), list(b"0123456789")]
    lengths = [120, 30, 20, 25]

    def one(i: int, params: dict[str, Any]) -> Future:
        body = {
            "input_ids": prompts[i],
            "sampling_params": {"max_new_tokens": lengths[i], "ignore_eos": True, **params},
            "return_logprob": True,
        }
        return pool.submit(post, client, "/generate", body, engine)

    for params in ({"temperature": 0}, {"temperature": 1.0, "sampling_seed": 5}):
        futures = [one(0, params)]
        wait_for(lambda: info(client)["num_running_reqs"] == 1)
        futures += [one(i, params) for i in (1, 2, 3)]
        for i, future in enumerate(futures):
            out = future.result(60)
            meta = out["meta_info"]
            assert meta["finish_reason"] == {"type": "length", "length": lengths[i]}
            assert meta["prompt_tokens"] == len(prompts[i])
            assert meta["completion_tokens"] == lengths[i] == len(out["output_ids"])
            assert meta["weight_version"] == "default"
            assert meta["e2e_latency"] > 0
            assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
            expected = full_forward_logprobs(reference, prompts[i], out["output_ids"])
            assert torch.allclose(torch.tensor(logprobs_of(out)), expected, atol=1e-4)
    assert info(client)["joined_running_batch"] - joined_before >= 3


def test_batch_input_and_n_give_a_list_in_sglang_order(client: httpx.Client):
    body = {
        "input_ids": [list(b"ab"), list(b"cde")],
        "sampling_params": {"max_new_tokens": 3, "n": 2, "sampling_seed": 1},
        "rid": ["p", "q"],
    }
    outs = post(client, "/generate", body)
    assert [o["meta_info"]["id"] for o in outs] == ["p-0", "p-1", "q-0", "q-1"]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 2, 3, 3]
    assert outs[0]["output_ids"] != outs[1]["output_ids"], "n samples must differ"
    again = post(client, "/generate", body)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]

    single = post(client, "/generate", {"input_ids": list(b"ab"), "sampling_params": {"n": 1}})
    assert isinstance(single, dict)


def test_sampling_params_over_http(client: httpx.Client):
    base = {"text": "Tell me", "sampling_params": {"max_new_tokens": 48, "sampling_seed": 9}}
    free = post(client, "/generate", base)
    assert free["meta_info"]["finish_reason"]["type"] == "length"
    text = free["text"]
    cut, stop = next((i, c) for i, c in enumerate(text) if i >= 2 and c.isascii() and c.isalnum())

    def gen(**params: Any) -> dict[str, Any]:
        body = json.loads(json.dumps(base))
        body["sampling_params"].update(params)
        return post(client, "/generate", body)

    trimmed = gen(stop=[stop])
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == text[:cut]
    assert gen(stop=stop, no_stop_trim=True)["text"] == text[: cut + 1]

    token = free["output_ids"][5]
    by_token = gen(stop_token_ids=[token])
    first = free["output_ids"].index(token)
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert by_token["output_ids"] == free["output_ids"][: first + 1]
    assert gen(stop_token_ids=[token], ignore_eos=True)["output_ids"] == free["output_ids"]

    short = gen(max_new_tokens=4)
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert short["output_ids"] == free["output_ids"][:4]
    assert gen(sampling_seed=10)["output_ids"] != free["output_ids"]

    greedy = gen(temperature=0, top_k=5, top_p=0.5, min_p=0.1)
    assert greedy["output_ids"] == gen(temperature=0)["output_ids"]


def test_streaming_sends_cumulative_chunks_then_done(client: httpx.Client):
    body = {
        "input_ids": list(b"stream"),
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        "return_logprob": True,
        "stream": True,
    }
    with client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    ids = [c["output_ids"] for c in chunks]
    assert all(a == b[: len(a)] for a, b in itertools.pairwise(ids)), "not cumulative"
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    plain = post(client, "/generate", {**body, "stream": False})
    assert ids[-1] == plain["output_ids"]


def test_abort_by_rid_and_abort_all_return_partial_output(
    client: httpx.Client, pool: ThreadPoolExecutor
):
    def start(rid: str) -> Future:
        body = {"input_ids": list(b"abort me"), "sampling_params": LONG, "rid": rid}
        return pool.submit(post, client, "/generate", body)

    one = start("victim")
    wait_for(lambda: info(client)["num_running_reqs"] == 1)
    time.sleep(0.2)
    assert post(client, "/abort_request", {"rid": "victim"})["num_aborted"] == 1
    out = one.result(30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < LONG["max_new_tokens"]
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"]

    many = [start(f"all-{i}") for i in range(3)]
    wait_for(lambda: info(client)["num_running_reqs"] == 3)
    assert post(client, "/abort_request", {"abort_all": True})["num_aborted"] == 3
    for future in many:
        assert future.result(30)["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_client_that_hangs_up_has_its_request_aborted(client: httpx.Client, engine):
    aborted = info(client)["aborted"]
    body = {"input_ids": list(b"gone"), "sampling_params": LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/generate", json=body, timeout=0.2)  # LONG takes ~0.75 s
    wait_for(lambda: info(client)["aborted"] == aborted + 1)
    wait_for(lambda: info(client)["num_running_reqs"] == 0)


def test_pause_abort_in_place_and_continue(client: httpx.Client, pool: ThreadPoolExecutor):
    body = {"input_ids": list(b"pause"), "sampling_params": LONG}
    running = pause_while_running(client, pool, body, "abort")
    assert running.result(30)["meta_info"]["finish_reason"]["type"] == "abort"

    short = {"input_ids": list(b"later"), "sampling_params": {"max_new_tokens": 5}}
    queued = pool.submit(post, client, "/generate", short)
    wait_for(lambda: info(client)["num_waiting_reqs"] == 1)
    time.sleep(0.3)
    assert not queued.done(), "a request ran while paused"
    post(client, "/continue_generation", {})
    assert queued.result(30)["meta_info"]["completion_tokens"] == 5

    kept = pause_while_running(
        client, pool, {"input_ids": list(b"keep"), "sampling_params": LONG}, "in_place"
    )
    try:
        state = info(client)
        assert state["paused"] and state["num_running_reqs"] == 1
        time.sleep(0.3)
        assert not kept.done()
    finally:  # never leave the module's shared engine paused for the next test
        post(client, "/continue_generation", {})
    assert kept.result(60)["meta_info"]["finish_reason"] == {"type": "length", "length": 1000}


def test_release_and_resume_memory_occupation(
    client: httpx.Client, pool: ThreadPoolExecutor, tiny_model_dir: Path
):
    """SGLang's colocation endpoints: a release retracts what runs and holds every request
    until the resume; the weights are discarded, so after the resume requests still wait,
    until a full update (here the checkpoint from disk) writes them back; then the retracted
    request ends as it would have without the release."""
    body = {"input_ids": list(b"colocated"), "sampling_params": {**LONG, "temperature": 0}}
    alone = post(client, "/generate", body)
    running = pool.submit(post, client, "/generate", body)
    wait_for(lambda: info(client)["num_running_reqs"] == 1)
    restore = {"model_path": str(tiny_model_dir)}
    try:
        released = post(client, "/release_memory_occupation", {})
        assert released["success"] and set(released["bytes"]) == {"kv_cache", "weights"}
        assert released["bytes"]["weights"] > 0  # freed on the CPU too
        state = info(client)
        assert state["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
        assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1
        post(client, "/continue_generation", {})  # not enough: memory is still released
        refused = client.post("/update_weights_from_disk", json=restore).json()
        assert not refused["success"] and "the weights are released" in refused["message"]
        time.sleep(0.3)
        assert not running.done(), "a request ran while the engine's memory was released"
        post(client, "/resume_memory_occupation", {"tags": ["weights"]})
        assert info(client)["memory_released"] == ["cuda_graph", "kv_cache"]
        post(client, "/resume_memory_occupation", {})
        state = info(client)
        assert state["memory_released"] == [] and state["weights_valid"] is False
        time.sleep(0.3)
        assert not running.done(), "a request ran on weights no update had written"
    finally:  # never leave the module's shared engine released, or its weights unwritten
        post(client, "/resume_memory_occupation", {})
        post(client, "/update_weights_from_disk", restore)
    after = running.result(60)
    assert after["output_ids"] == alone["output_ids"]
    assert info(client)["weights_valid"] is True


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}}, "max_tokens"),
        ("/generate", {"input_ids": [1], "bogus": True}, "bogus"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ("/generate", {"input_ids": "abc"}, "input_ids"),
        ("/generate", {"input_ids": []}, "input_ids"),
        ("/generate", {"input_ids": [1, 99999]}, "vocabulary"),
        ("/generate", {"input_ids": [1] * 2000}, "context length"),
        ("/generate", {"sampling_params": {}}, "text or input_ids"),
        (
            "/generate",
            {"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}},
            "not supported",
        ),
        ("/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
        ("/abort_request", {}, "rid"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags"),
        ("/init_weights_update_group", {"master_address": "x"}, "master_port"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []}, "names"),
        ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_input(client: httpx.Client, path, body, field):
    resp = client.post(path, json=body)
    assert 400 <= resp.status_code < 500, resp.text
    assert field in resp.json()["message"], resp.text


def test_malformed_json_is_a_400(client: httpx.Client):
    resp = client.post(
        "/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400
    assert "invalid JSON" in resp.json()["message"]


def test_weight_updates_with_bad_inputs_fail_with_success_false(client: httpx.Client):
    resp = client.post(
        "/update_weights_from_distributed",
        json={"names": ["nope"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
    )
    assert resp.status_code == 400
    assert resp.json()["success"] is False and "nope" in resp.json()["message"]
    resp = client.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["!!"]})
    assert resp.json()["success"] is False and "base64" in resp.json()["message"]
    resp = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert resp.json()["success"] is False and "/nonexistent" in resp.json()["message"]
    resp = client.post("/destroy_weights_update_group", json={"group_name": "none"})
    assert resp.json()["success"] is False
    if client.get("/get_server_info").json()["placement"]["device"] == "cpu":
        init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
        resp = client.post("/init_weights_update_group", json={**init, "backend": "nccl"})
        assert resp.json()["success"] is False and "use gloo" in resp.json()["message"]


def test_info_and_health_endpoints(client: httpx.Client, tiny_model_dir: Path):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    model = client.get("/get_model_info").json()
    assert model["model_path"] == str(tiny_model_dir) and model["is_generation"] is True
    server = client.get("/get_server_info").json()
    assert server["max_running_requests"] == 64 and "admin_token" not in server
    # SGLang's current names for the two (the /get_* ones stay): the same answers
    assert client.get("/model_info").json() == model
    again = client.get("/server_info").json()
    assert again.keys() == server.keys() and again["model_path"] == server["model_path"]
    assert client.get("/get_weight_version").json() == {"weight_version": "default"}
    assert client.post("/flush_cache").json()["success"] is True


def test_openai_endpoints_answer_with_openai_shapes(client: httpx.Client, tiny_model_dir: Path):
    from transformers import AutoTokenizer

    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == str(tiny_model_dir)

    comp = post(
        client, "/v1/completions", {"prompt": "Hello", "max_tokens": 5, "logprobs": 1, "n": 2}
    )
    assert comp["object"] == "text_completion" and comp["id"].startswith("cmpl-")
    assert [c["index"] for c in comp["choices"]] == [0, 1]
    assert comp["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(comp["choices"][0]["logprobs"]["token_logprobs"]) <= 5
    assert comp["usage"]["prompt_tokens"] == 5
    assert comp["usage"]["total_tokens"] == 5 + comp["usage"]["completion_tokens"]

    chat_body = {
        "model": "anything",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
    }
    chat = post(client, "/v1/chat/completions", chat_body)
    assert chat["object"] == "chat.completion"
    choice = chat["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert len(choice["logprobs"]["content"]) == chat["usage"]["completion_tokens"]
    template = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    expected_prompt = tokenizer.encode(template, add_special_tokens=False)
    assert chat["usage"]["prompt_tokens"] == len(expected_prompt)

    stream_body = {**chat_body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=stream_body) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"] == chat["usage"]
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1])
    assert streamed == choice["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]

    comp_body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=comp_body) as resp:
        lines = [line for line in resp.iter_lines() if line]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = post(client, "/v1/completions", {**comp_body, "stream": False})
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_the_engine_prints_the_compute_threads_it_runs_with(engine: EngineProcess):
    # tests/support/engine_proc.py starts engines with --num-threads 1 (the CPU budget);
    # the line is torch's own count, read back after setting it.
    assert "[engine] 1 compute thread(s)" in engine.log_tail(100_000)


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics, parsed: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def test_metrics_count_generated_tokens_and_show_the_weight_version(
    client: httpx.Client, engine: EngineProcess, tiny_model_dir: Path
):
    tokens = ("millstream_engine_generated_tokens_total", ())
    finished = ("millstream_engine_completions_total", (("outcome", "finished"),))
    version = ("millstream_engine_weight_version", ())
    before = scrape(client)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    out = post(client, "/generate", body)
    assert out["meta_info"]["completion_tokens"] == 4
    after = scrape(client)
    assert after[tokens] - before[tokens] >= 4  # other tests' aborted leftovers may add some
    assert after[finished] - before[finished] >= 1
    assert after[("millstream_engine_running_requests", ())] >= 0

    was = client.get("/get_weight_version").json()["weight_version"]
    assert was != "7"
    if was == "default":  # no integer: no number to report
        assert math.isnan(before[version])
    reload = {"model_path": str(tiny_model_dir), "weight_version": "7"}
    try:
        assert post(client, "/update_weights_from_disk", reload, engine)["success"] is True
        assert scrape(client)[version] == 7
    finally:  # the same weights back under the version the other tests expect
        post(client, "/update_weights_from_disk", {**reload, "weight_version": was}, engine)
    assert client.get("/get_weight_version").json() == {"weight_version": was}
