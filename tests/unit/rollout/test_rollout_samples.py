"""Rollout worker, pure parts: samples from /generate answers, plans (eval inheritance),
seeds, partial-resume bookkeeping, the buffer filter order, priority slots, flags."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.common.types import PromptGroup, SampleStatus
from millstream.compat.miles import Sample as MilesSample
from millstream.compat.plugins import load_function
from millstream.rollout.client import FRESH, Slots
from millstream.rollout.config import (
    SEED_MODULUS,
    derive_seed,
    parse_worker_args,
    plan_for,
)
from millstream.rollout.generate import (
    BadAnswer,
    add_rollout_metadata,
    append_answer,
    mask_prefix,
    new_sample,
    next_input_ids,
    reset_response,
)
from millstream.rollout.partial import fifo, resume_order
from tests.support.rollout_plugins import drops_all, longest_first

ROOT = Path(__file__).resolve().parents[3]


def answer(tokens, logprobs, finish="stop", version="3", text="xyz", output_ids=True):
    out = {
        "text": text,
        "meta_info": {
            "finish_reason": {"type": finish},
            "prompt_tokens": 4,
            "completion_tokens": len(tokens),
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(logprobs, tokens, strict=True)
            ],
            "weight_version": version,
        },
    }
    if output_ids:
        out["output_ids"] = list(tokens)
    return out


def group(**kw) -> PromptGroup:
    fields = dict(group_id="g1", prompt_token_ids=[1, 2, 3], label="42", admitted_version=2)
    fields.update(kw)
    return PromptGroup(**fields)


def cfg(*flags: str):
    return parse_run_config(["--rollout-batch-size", "2", *flags], mode="async")


def test_sample_from_one_answer():
    sample = new_sample(group(metadata_json='{"k": 1}'), 1)
    finish = append_answer(sample, answer([7, 8, 9], [-0.5, -1.0, -0.25]), fallback_version=2)
    assert finish == "stop"
    assert (sample.group_id, sample.index, list(sample.prompt_token_ids)) == ("g1", 1, [1, 2, 3])
    assert list(sample.response_token_ids) == [7, 8, 9]
    assert list(sample.rollout_logprobs) == [-0.5, -1.0, -0.25]
    assert list(sample.weight_versions) == [3, 3, 3]
    assert list(sample.loss_mask) == [1, 1, 1]
    assert sample.status == SampleStatus.SAMPLE_STATUS_COMPLETED
    assert (sample.finish_reason, sample.response_text, sample.label) == ("stop", "xyz", "42")
    add_rollout_metadata(sample, requests=1, aborts=0)
    assert json.loads(sample.metadata_json) == {"k": 1, "rollout": {"requests": 1, "aborts": 0}}


@pytest.mark.parametrize(
    ("finish", "status"),
    [
        ("length", SampleStatus.SAMPLE_STATUS_TRUNCATED),
        ("abort", SampleStatus.SAMPLE_STATUS_ABORTED),
    ],
)
def test_status_follows_finish_reason(finish, status):
    sample = new_sample(group(), 0)
    append_answer(sample, answer([5], [-1.0], finish=finish), fallback_version=0)
    assert sample.status == status and sample.finish_reason == finish


def test_tokens_come_from_the_logprobs_when_output_ids_are_absent():
    sample = new_sample(group(), 0)
    append_answer(sample, answer([4, 6], [-1.0, -2.0], output_ids=False), fallback_version=0)
    assert list(sample.response_token_ids) == [4, 6]


def test_a_version_that_is_not_an_integer_falls_back_to_the_admitted_one():
    sample = new_sample(group(), 0)
    append_answer(sample, answer([4], [-1.0], version="default"), fallback_version=2)
    assert list(sample.weight_versions) == [2]


def test_bad_answers_are_named():
    sample = new_sample(group(), 0)
    mismatched = answer([4, 5], [-1.0, -1.0])
    mismatched["output_ids"] = [4]
    with pytest.raises(BadAnswer, match="disagree"):
        append_answer(sample, mismatched, fallback_version=0)
    no_logprobs = answer([4], [-1.0])
    del no_logprobs["meta_info"]["output_token_logprobs"]
    with pytest.raises(BadAnswer, match="return_logprob"):
        append_answer(sample, no_logprobs, fallback_version=0)
    assert not BadAnswer("x").retryable


def test_partial_resume_concatenates_tokens_logprobs_and_versions():
    sample = new_sample(group(), 0)
    append_answer(sample, answer([7, 8], [-0.1, -0.2], finish="abort", version="3", text="ab"),
                  fallback_version=0)  # fmt: skip
    assert next_input_ids(sample) == [1, 2, 3, 7, 8]
    append_answer(sample, answer([9], [-0.3], version="4", text="c"), fallback_version=0)
    assert list(sample.response_token_ids) == [7, 8, 9]
    assert list(sample.rollout_logprobs) == pytest.approx([-0.1, -0.2, -0.3])
    assert list(sample.weight_versions) == [3, 3, 4]
    assert list(sample.loss_mask) == [1, 1, 1]
    assert sample.response_text == "abc" and sample.status == SampleStatus.SAMPLE_STATUS_COMPLETED


def test_offpolicy_mask_and_reset():
    sample = new_sample(group(), 0)
    append_answer(sample, answer([7, 8], [-0.1, -0.2], finish="abort"), fallback_version=0)
    mask_prefix(sample)
    append_answer(sample, answer([9], [-0.3]), fallback_version=0)
    assert list(sample.loss_mask) == [0, 0, 1]
    reset_response(sample)
    assert not sample.response_token_ids and not sample.loss_mask and not sample.weight_versions
    assert not sample.rollout_logprobs and sample.response_text == "" and not sample.status


def test_a_group_carried_back_resumes_its_partial_samples():
    carried = new_sample(group(), 1)
    append_answer(carried, answer([7], [-0.1], finish="abort"), fallback_version=0)
    g = group(n_samples=2)
    g.partial_samples.append(carried)
    assert list(new_sample(g, 1).response_token_ids) == [7]
    assert not new_sample(g, 0).response_token_ids


def test_plan_uses_rollout_flags_for_training_groups():
    c = cfg("--n-samples-per-prompt", "4", "--rollout-temperature", "0.7",
            "--rollout-top-p", "0.9", "--rollout-top-k", "20", "--rollout-min-p", "0.05",
            "--rollout-max-response-len", "64", "--rollout-stop", "###",
            "--rollout-stop-token-ids", "5", "6")  # fmt: skip
    plan = plan_for(group(), c)
    assert plan.n_samples == 4
    assert plan.sampling_params == {
        "max_new_tokens": 64,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "stop": ["###"],
        "stop_token_ids": [5, 6],
    }
    assert plan_for(group(n_samples=3), c).n_samples == 3


def test_eval_groups_inherit_rollout_values_unless_overridden():
    c = cfg("--n-samples-per-prompt", "4", "--rollout-temperature", "0.7",
            "--rollout-top-k", "20", "--rollout-max-response-len", "64",
            "--eval-temperature", "0", "--eval-max-response-len", "16",
            "--n-samples-per-eval-prompt", "2")  # fmt: skip
    plan = plan_for(group(is_eval=True, eval_name="aime"), c)
    assert plan.n_samples == 2
    params = plan.sampling_params
    assert (params["temperature"], params["max_new_tokens"]) == (0, 16)
    assert (params["top_k"], params["top_p"]) == (20, 1.0)  # inherited
    assert plan.seed_key != plan_for(group(), c).seed_key


def test_seeds_are_stable_and_differ_where_they_should():
    c = cfg()
    key = plan_for(group(data_index=5, epoch=1), c).seed_key
    seed = derive_seed(key, 0)
    assert seed == derive_seed(key, 0) and 0 <= seed < SEED_MODULUS
    others = {
        derive_seed(key, 1),
        derive_seed(key, 0, tokens_done=10),
        derive_seed(plan_for(group(data_index=6, epoch=1), c).seed_key, 0),
        derive_seed(plan_for(group(data_index=5, epoch=2), c).seed_key, 0),
        derive_seed(plan_for(group(data_index=5, epoch=1), cfg("--rollout-seed", "7")).seed_key, 0),
    }
    assert seed not in others and len(others) == 5
    # Group ids are not part of the seed: a rerun of the same run gives new ids.
    assert plan_for(group(group_id="other", data_index=5, epoch=1), c).seed_key == key


def test_buffer_filter_order_fifo_custom_and_left_out():
    groups = [group(group_id=f"g{i}") for i in range(3)]
    for i, g in enumerate(groups):
        sample = new_sample(g, 0)
        append_answer(sample, answer([1] * (i + 1), [-1.0] * (i + 1), finish="abort"),
                      fallback_version=0)  # fmt: skip
        g.partial_samples.append(sample)
    assert resume_order(groups, fifo) == ["g0", "g1", "g2"]
    assert resume_order(groups, longest_first) == ["g2", "g1", "g0"]
    assert resume_order(groups, drops_all) == ["g0", "g1", "g2"]
    # Miles' signature: (args, rollout_id, buffer, num_samples), buffer a list[list[Sample]]
    assert resume_order(groups, lambda args, rid, buf, n: [buf[1]]) == ["g1", "g0", "g2"]
    # a copy of a group's list still names its group by the samples' group_id
    assert resume_order(groups, lambda a, r, buf, n: [list(buf[2])]) == ["g2", "g0", "g1"]
    seen = []
    resume_order(groups, lambda *call: seen.append(call) or [], "ARGS")
    [(args, rollout_id, buffer, num_samples)] = seen
    assert (args, rollout_id, num_samples) == ("ARGS", None, 3)
    assert [[s.response_length for s in g] for g in buffer] == [[1], [2], [3]]
    assert buffer[0][0].group_id == "g0" and buffer[0][0].status.name == "ABORTED"
    with pytest.raises(ValueError, match="not in the buffer"):
        resume_order(groups, lambda *_: [[MilesSample(group_id="stranger")]])


def test_slots_serve_by_priority_then_arrival():
    async def main() -> list[str]:
        slots = Slots(1)
        await slots.acquire()
        order: list[str] = []

        async def take(name: str, priority: int) -> None:
            await slots.acquire(priority)
            order.append(name)
            slots.release()

        tasks = [
            asyncio.create_task(take("fresh-a", FRESH)),
            asyncio.create_task(take("fresh-b", FRESH)),
            asyncio.create_task(take("resumed-1", 1)),
            asyncio.create_task(take("resumed-0", 0)),
            asyncio.create_task(take("cancelled", 0)),
        ]
        await asyncio.sleep(0)
        tasks[-1].cancel()
        await asyncio.sleep(0)
        slots.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert slots.busy == 0
        return order

    assert asyncio.run(main()) == ["resumed-0", "resumed-1", "fresh-a", "fresh-b"]


def test_worker_flags(capsys):
    args = parse_worker_args(["--redis-url", "redis://x:1/0", "--run-id", "r1"])
    assert (args.redis_url, args.run_id, args.router_url) == ("redis://x:1/0", "r1", None)
    for argv in (["--run-id", "r1"], ["--redis-url", "redis://x", "--run-id", "r", "--run"]):
        with pytest.raises(SystemExit) as err:
            parse_worker_args(argv)
        assert err.value.code == 2
    assert "--redis-url is required" in capsys.readouterr().err


def test_plugins_are_loaded_by_path_with_a_clear_error():
    assert load_function("tests.support.rollout_plugins.longest_first", "--x") is longest_first
    with pytest.raises(
        MillstreamError, match=r"--buffer-filter-path .nope\.mod\.fn.*cannot import"
    ):
        load_function("nope.mod.fn", "--buffer-filter-path")
    with pytest.raises(MillstreamError, match="has no 'missing'"):
        load_function("tests.support.rollout_plugins.missing", "--rollout-function-path")


def test_importing_the_worker_does_not_pull_torch_in():
    code = (
        "import sys, millstream.rollout.main, millstream.rollout.worker\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'fastapi', 'uvicorn'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
