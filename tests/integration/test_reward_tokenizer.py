"""The tokenizer the run config names, as a reward worker process reads it: a relative
--hf-checkpoint reaches a worker started in another directory as the trainer's absolute path,
and a worker that cannot load the tokenizer its `exact` reward decodes with fails at start,
naming the path, instead of scoring the response text."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from millstream.common.config import parse_run_config
from millstream.common.types import PromptGroup, Sample, SampleGroup, Verdict
from tests.support.reward_proc import RewardProcs, collect_scored, publish_config, publish_groups
from tests.support.worker_procs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def run_id() -> str:
    return f"tok{uuid.uuid4().hex[:8]}"


def _cfg(run_id: str, *flags: str):
    return parse_run_config(
        ["--run-id", run_id, "--rollout-batch-size", "1", "--stream-block-ms", "100", *flags],
        mode="async",
    )


def test_a_worker_that_cannot_load_the_runs_tokenizer_fails_at_start(redis_url, run_id, tmp_path):
    missing = tmp_path / "model"  # a relative path resolved elsewhere would name nothing, too
    missing.mkdir()
    (missing / "config.json").write_text("{}")
    asyncio.run(publish_config(redis_url, _cfg(run_id, "--rm-type", "exact", "--hf-checkpoint", str(missing))))  # fmt: skip
    procs = RewardProcs(redis_url, run_id, tmp_path)
    try:
        code = procs.reward("reward-0").wait(timeout=60)
    finally:
        procs.stop_all()
    log = procs.log("reward-0")
    assert code == 1, log
    assert "millstream reward: error: the exact reward cannot load the tokenizer" in log, log
    assert f"{missing}/tokenizer.json: no such file" in log, log
    assert "Traceback" not in log and "scoring response_text" not in log, log


def test_a_relative_model_path_reaches_a_worker_started_elsewhere(
    redis_url, run_id, tmp_path, tiny_model_dir, monkeypatch
):
    """The trainer parses `--hf-checkpoint tiny-model0` in the model's parent directory; the
    worker runs in the repository root and decodes the response tokens with that tokenizer:
    the answer the tokens spell is right, the text the engine returned beside them is not."""
    from tokenizers import Tokenizer

    monkeypatch.chdir(tiny_model_dir.parent)
    cfg = _cfg(run_id, "--rm-type", "exact", "--hf-checkpoint", tiny_model_dir.name)
    assert cfg.ckpt.hf_checkpoint == str(tiny_model_dir)
    assert tiny_model_dir.parent != ROOT
    asyncio.run(publish_config(redis_url, cfg))
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = [*tok.encode("42").ids, tok.token_to_id("<|im_end|>")]
    sample = Sample(
        group_id="g", index=0, response_text="the text", label="42",
        response_token_ids=ids, finish_reason="stop",
    )  # fmt: skip
    group = SampleGroup(prompt=PromptGroup(group_id="g", n_samples=1), samples=[sample])
    procs = RewardProcs(redis_url, run_id, tmp_path)
    try:
        procs.reward("reward-0")
        procs.wait_beating("reward", "reward-0")

        async def score():
            from millstream.common.redis_conn import connect

            redis = await connect(redis_url)
            try:
                await publish_groups(redis, run_id, [group])
                return await collect_scored(redis, run_id, 1, timeout_s=30)
            finally:
                await redis.aclose()

        [(scored, _fields)] = asyncio.run(score())
    finally:
        procs.stop_all()
    assert scored.verdict == Verdict.VERDICT_KEPT, scored.reason
    assert scored.group.samples[0].reward == 1.0
