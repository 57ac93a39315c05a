"""Partial rollout through a real engine and router: the engine is paused with mode abort
mid-generation, its weights are reloaded under a new version, the router serves that version,
generation continues; the worker resumes the sample from its partial tokens (in the order
Miles' buffer filter, `--buffer-filter-path`, picks), and the result
equals one uninterrupted greedy generation under the same weights, with per-token versions
showing the split."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from millstream.common.config import parse_run_config
from millstream.common.keys import GROUP_ROLLOUT, RunKeys
from millstream.common.types import PromptGroup, SampleGroup
from tests.support.engine_proc import EngineProcess
from tests.support.reward_proc import publish_config
from tests.support.rollout_proc import RolloutProcs, pending_count, publish_prompts, read_stream
from tests.support.router_proc import ServiceProcess, start_router

pytestmark = pytest.mark.integration

PROMPT = [250, 3, 77, 140, 9, 33, 180]
MAX_NEW = 1000  # long enough that the pause lands mid-generation on a fast machine


@pytest.fixture(scope="module")
def serving(
    tiny_model_dir: Path, tmp_path_factory
) -> Iterator[tuple[EngineProcess, ServiceProcess]]:
    workdir = tmp_path_factory.mktemp("partial")
    engine = EngineProcess(tiny_model_dir, workdir, "--weight-version", "0", startup_timeout_s=180)
    try:
        router = start_router(
            workdir, "--worker-urls", engine.url, "--health-check-interval", "0.5"
        )
        try:
            yield engine, router
        finally:
            router.stop()
    finally:
        engine.stop()


def wait_until_running(engine_url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = httpx.get(f"{engine_url}/get_server_info", timeout=5).json()
        if info["scheduler"]["num_running_reqs"] > 0:
            return
        time.sleep(0.02)
    raise AssertionError("the rollout worker's request never reached the engine")


def post(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.timeout(180)
def test_a_sample_aborted_by_a_sync_resumes_as_if_never_interrupted(
    serving, redis_url, tiny_model_dir, tmp_path
):
    engine, router = serving
    run_id = f"t{uuid.uuid4().hex[:8]}"
    keys = RunKeys(run_id)
    cfg = parse_run_config(
        ["--run-id", run_id, "--router-url", router.url, "--rollout-batch-size", "1",
         "--n-samples-per-prompt", "1", "--rollout-temperature", "0",
         "--rollout-max-response-len", str(MAX_NEW), "--partial-rollout",
         "--buffer-filter-path", "tests.support.miles_plugins.buffer_filter",
         "--stream-block-ms", "50"],
        mode="async",
    )  # fmt: skip
    reference = post(
        f"{engine.url}/generate",
        {"input_ids": PROMPT, "return_logprob": True,
         "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "no_stop_trim": True,
                             "skip_special_tokens": False}},
    )  # fmt: skip
    ref_tokens = reference["output_ids"]
    ref_logprobs = [pair[0] for pair in reference["meta_info"]["output_token_logprobs"]]

    asyncio.run(publish_config(redis_url, cfg))
    procs = RolloutProcs(redis_url, run_id, tmp_path)
    try:
        procs.start("r1")
        procs.wait_ready("r1")
        publish_prompts(
            redis_url, keys.prompts, [PromptGroup(group_id="p0", prompt_token_ids=PROMPT)]
        )
        wait_until_running(engine.url)  # its prefill sampled the first token at version 0
        time.sleep(0.05)
        paused = post(f"{engine.url}/pause_generation", {"mode": "abort"})
        assert paused["num_paused_requests"] == 1
        # The coordinator's order: weights (same ones, new version), then serve it, continue.
        post(f"{engine.url}/update_weights_from_disk",
             {"model_path": str(tiny_model_dir), "weight_version": "1"})  # fmt: skip
        post(f"{router.url}/set_weight_version", {"weight_version": "1"})
        post(f"{engine.url}/continue_generation", {})
        ((group, _fields),) = read_stream(redis_url, keys.generated, SampleGroup, 1, 60)
        assert procs.stop("r1") == 0
    finally:
        procs.stop_all()
        httpx.post(f"{router.url}/set_weight_version", json={"weight_version": None})

    assert not group.failure_reason, group.failure_reason
    (sample,) = group.samples
    assert list(sample.response_token_ids) == ref_tokens
    assert list(sample.rollout_logprobs) == pytest.approx(ref_logprobs, abs=1e-4)
    versions = list(sample.weight_versions)
    split = versions.index(1)
    assert 0 < split < len(versions)
    assert versions == [0] * split + [1] * (len(versions) - split)
    assert list(sample.loss_mask) == [1] * len(ref_tokens)
    assert sample.finish_reason == reference["meta_info"]["finish_reason"]["type"]
    assert pending_count(redis_url, keys.prompts, GROUP_ROLLOUT) == 0
    assert "resuming 1 partial group" in procs.log("r1")
    # Miles' buffer filter, as its docs write it, chose the resume order (its own log line)
    assert "miles buffer_filter: rollout_id=None popped 1 of 1" in procs.log("r1")
    assert "partial_rollout=True" in procs.log("r1")
