"""GroupScorer verdicts without servers: custom rewards (sync, async, dict, group), failures
that must never become a 0 (raise, hang past the timeout, NaN), retries, pass-through of
failed rollouts, and the dynamic-sampling filters."""

from __future__ import annotations

import asyncio
import time

import pytest

from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.common.types import PromptGroup, Sample, SampleGroup, SampleStatus, Verdict
from millstream.compat.miles import Sample as MilesSample
from millstream.compat.miles import make_args
from millstream.reward.filters import check_no_aborted, check_reward_nonzero_std, resolve_filter
from millstream.reward.rewarder import Rewarder
from millstream.reward.scorer import GroupScorer
from tests.support.scoring import score_groups as score

PLUGINS = "tests.support.reward_plugins"


def make_cfg(*flags: str):
    return parse_run_config(["--run-id", "t", "--rollout-batch-size", "1", *flags], mode="async")


def make_group(responses, label="4", gid="g", **prompt):
    labels = label if isinstance(label, list) else [label] * len(responses)
    return SampleGroup(
        prompt=PromptGroup(group_id=gid, prompt_text="2+2?", n_samples=len(responses), **prompt),
        samples=[
            Sample(group_id=gid, index=i, response_text=r, label=lab)
            for i, (r, lab) in enumerate(zip(responses, labels, strict=True))
        ],
    )


def rewards(scored):
    return [s.reward for s in scored.group.samples]


def test_math_group_is_kept_with_rewards_and_timing():
    group = make_group(["\\boxed{4}", "it is 5", "4.0"])
    # millstream's math reads an unboxed last number; Miles' does not (test_rm_miles_parity.py)
    [out], stats = score(make_cfg("--rm-type", "math", "--rm-compat", "millstream"), group)
    assert out.verdict == Verdict.VERDICT_KEPT and out.reason == ""
    assert rewards(out) == [1.0, 0.0, 1.0]
    assert out.group.timings["reward"] > 0
    assert [s.reward for s in group.samples] == [0.0, 0.0, 0.0]  # the input is not modified
    assert stats["kept"] == 1


@pytest.mark.parametrize("fn", ["exact_sync", "exact_async"])
def test_custom_reward_sync_or_async(fn):
    [out], _ = score(make_cfg("--custom-rm-path", f"{PLUGINS}.{fn}"), make_group(["4", "5"]))
    assert out.verdict == Verdict.VERDICT_KEPT and rewards(out) == [1.0, 0.0]


def test_dict_reward_with_reward_key():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.dict_reward", "--reward-key", "acc")
    [out], _ = score(cfg, make_group(["4", "five"]))
    assert rewards(out) == [1.0, 0.0]


def test_group_reward_scores_the_whole_group():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.group_reward", "--group-rm")
    [out], _ = score(cfg, make_group(["ccc", "a", "bb"]))
    assert out.verdict == Verdict.VERDICT_KEPT and rewards(out) == [2.0, 0.0, 1.0]


def test_group_reward_of_wrong_length_fails_the_group():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.group_reward_wrong_length", "--group-rm")
    [out], _ = score(cfg, make_group(["a", "b"]))
    assert out.verdict == Verdict.VERDICT_FAILED and "(--group-rm)" in out.reason
    assert "list of 2 rewards (got 1 values)" in out.reason
    assert out.plugin_error.flag == "--custom-rm-path" and out.plugin_error.type == "ValueError"


def test_metadata_rm_type_overrides_the_run_default():
    group = make_group(["The Eiffel Tower", "Paris"], label="eiffel tower")
    group.samples[0].metadata_json = '{"rm_type": "f1"}'
    [out], _ = score(make_cfg("--rm-type", "exact"), group)
    assert rewards(out) == [1.0, 0.0]


def test_instant_rules_are_scored_inline_and_a_slow_rule_takes_the_usual_way():
    """A group whose rewards are all instant rules (exact, f1) is scored in one go, without a
    per-sample attempt; one sample whose metadata names math sends the group the usual way."""

    class Counting(Rewarder):
        attempts = 0

        async def sample_reward(self, sample, prompt):
            Counting.attempts += 1
            return await super().sample_reward(sample, prompt)

    cfg = make_cfg("--rm-type", "exact")

    async def go(group):
        scorer = GroupScorer(cfg, Counting(cfg))
        return await scorer.score(group)

    out = asyncio.run(go(make_group(["4", " 4 ", "5"])))
    assert rewards(out) == [1.0, 1.0, 0.0] and Counting.attempts == 0
    mixed = make_group(["4", "\\boxed{4}"])
    mixed.samples[1].metadata_json = '{"rm_type": "math"}'
    out = asyncio.run(go(mixed))
    assert rewards(out) == [1.0, 1.0] and Counting.attempts == 2


def test_raising_reward_fails_the_group_at_once_with_its_error_and_the_next_group_is_fine():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.misbehaving", "--reward-retries", "1")
    bad = make_group(["4", "x"], label=["4", "boom"], gid="bad")
    good = make_group(["4", "5"], gid="good")
    (failed, kept), stats = score(cfg, bad, good)
    assert failed.verdict == Verdict.VERDICT_FAILED
    assert failed.reason == (
        f"reward: --custom-rm-path {PLUGINS}.misbehaving raised RuntimeError: "
        "reward exploded on 'x'"
    )
    error = failed.plugin_error
    assert (error.flag, error.path, error.service) == (
        "--custom-rm-path",
        f"{PLUGINS}.misbehaving",
        "reward",
    )
    assert error.type == "RuntimeError"
    # The traceback starts in the plugin, not in the scorer that called it.
    assert error.traceback.startswith("Traceback (most recent call last):\n  File ")
    assert "reward_plugins.py" in error.traceback.splitlines()[1]
    assert 'raise RuntimeError(f"reward exploded' in error.traceback
    assert rewards(failed) == [0.0, 0.0]  # nothing filled in: the verdict says why
    assert kept.verdict == Verdict.VERDICT_KEPT and rewards(kept) == [1.0, 0.0]
    assert not kept.HasField("plugin_error")
    assert stats["failed"] == 1 and stats["reward_plugin_errors"] == 1  # no retry of a bug
    assert stats["reward_errors"] == 0 and stats["reward_retries"] == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fn", ["misbehaving", "hangs_async"])
def test_hanging_reward_times_out_into_a_failed_group(fn):
    cfg = make_cfg(
        "--custom-rm-path", f"{PLUGINS}.{fn}", "--reward-timeout", "0.3", "--reward-retries", "1"
    )
    started = time.monotonic()
    (failed, kept), stats = score(
        cfg, make_group(["4", "4"], label=["4", "hang"], gid="h"), make_group(["4"], gid="ok")
    )
    assert time.monotonic() - started < 5
    assert failed.verdict == Verdict.VERDICT_FAILED
    assert "sample 1" in failed.reason and "timed out after 0.3 s" in failed.reason
    assert kept.verdict == Verdict.VERDICT_KEPT and rewards(kept) == [1.0]
    assert stats["reward_timeouts"] == 2


def test_flaky_reward_is_retried_and_kept():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.misbehaving", "--reward-retries", "2")
    [out], stats = score(cfg, make_group(["x"], label="flaky", gid="flaky-kept"))
    assert out.verdict == Verdict.VERDICT_KEPT and rewards(out) == [1.0]
    assert stats["reward_retries"] == 1 and stats["reward_errors"] == 1


def test_flaky_reward_without_retries_fails():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.misbehaving", "--reward-retries", "0")
    [out], _ = score(cfg, make_group(["x"], label="flaky", gid="flaky-failed"))
    assert out.verdict == Verdict.VERDICT_FAILED
    assert "ConnectionError" in out.reason and "1 attempt" in out.reason


def test_nan_reward_is_a_failure_not_a_number():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.returns_nan", "--reward-retries", "0")
    [out], _ = score(cfg, make_group(["4"]))
    assert out.verdict == Verdict.VERDICT_FAILED and "finite number" in out.reason


def test_failed_rollouts_pass_through_unscored():
    cfg = make_cfg("--custom-rm-path", f"{PLUGINS}.misbehaving")
    gave_up = make_group(["x"], label="boom", gid="a")
    gave_up.failure_reason = "router unreachable after 3 retries"
    bad_sample = make_group(["4", "x"], gid="b")
    bad_sample.samples[1].status = SampleStatus.SAMPLE_STATUS_FAILED
    bad_sample.samples[1].failure_reason = "engine 500"
    empty = SampleGroup(prompt=PromptGroup(group_id="c"))
    outs, stats = score(cfg, gave_up, bad_sample, empty)
    assert [o.verdict for o in outs] == [Verdict.VERDICT_FAILED] * 3
    assert outs[0].reason == "router unreachable after 3 retries"
    assert outs[1].reason == "sample 1 failed in rollout: engine 500"
    assert "no samples" in outs[2].reason
    assert stats["reward_errors"] == 0


def test_nonzero_std_filter_drops_all_equal_groups():
    cfg = make_cfg(
        "--rm-type",
        "math",
        "--dynamic-sampling-filter-path",
        "check_reward_nonzero_std",
        "--rm-compat",
        "millstream",
    )
    all_right = make_group(["\\boxed{4}", "4"], gid="same")
    mixed = make_group(["\\boxed{4}", "5"], gid="mixed")
    evals = make_group(["4", "4"], gid="eval", is_eval=True)
    (dropped, kept, evaluated), stats = score(cfg, all_right, mixed, evals)
    assert dropped.verdict == Verdict.VERDICT_FILTERED
    assert dropped.reason.startswith("zero_std_1.0") and rewards(dropped) == [1.0, 1.0]
    assert kept.verdict == Verdict.VERDICT_KEPT
    assert evaluated.verdict == Verdict.VERDICT_KEPT  # eval groups are never filtered
    assert stats["filtered"] == 1


@pytest.mark.parametrize(
    "path",
    [
        "check_no_aborted",
        "millstream.reward.filters.check_no_aborted",
        "miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted",
    ],
)
def test_no_aborted_filter_drops_groups_with_an_aborted_sample(path):
    cfg = make_cfg("--rm-type", "exact", "--dynamic-sampling-filter-path", path)
    group = make_group(["4", "5"])
    group.samples[1].status = SampleStatus.SAMPLE_STATUS_ABORTED
    [out], _ = score(cfg, group)
    assert out.verdict == Verdict.VERDICT_FILTERED and "group_has_aborted" in out.reason
    assert rewards(out) == [1.0, 0.0]


def test_custom_filter_and_a_filter_that_raises():
    keep = make_cfg(
        "--rm-type", "exact", "--dynamic-sampling-filter-path", f"{PLUGINS}.keep_if_any_correct"
    )
    (wrong, right), _ = score(keep, make_group(["5", "6"], gid="w"), make_group(["4"], gid="r"))
    assert wrong.verdict == Verdict.VERDICT_FILTERED and wrong.reason == "no sample is correct"
    assert right.verdict == Verdict.VERDICT_KEPT
    raises = make_cfg(
        "--rm-type", "exact", "--dynamic-sampling-filter-path", f"{PLUGINS}.filter_raises"
    )
    [out], _ = score(raises, make_group(["4"]))
    assert out.verdict == Verdict.VERDICT_FAILED and "ValueError: filter bug" in out.reason


def test_builtin_filters_directly():
    args = make_args(make_cfg())
    same = [MilesSample(reward=0.0), MilesSample(reward=0.0)]
    assert not check_reward_nonzero_std(args, same).keep
    assert check_reward_nonzero_std(args, [MilesSample(reward=0.0), MilesSample(reward=1.0)]).keep
    assert check_no_aborted(args, same).keep
    aborted = [MilesSample(index=1, status=MilesSample.Status.ABORTED)]
    assert check_no_aborted(args, aborted, extra="ignored").reason.startswith("group_has_aborted")
    assert resolve_filter("slime.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted") is (
        check_no_aborted
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rm-type", "mathh"], "unknown rm_type 'mathh'"),
        (["--custom-rm-path", "tests.support.nope.fn"], "cannot import module"),
        (["--custom-rm-path", f"{PLUGINS}.nope"], "has no 'nope'"),
        (["--group-rm", "--rm-type", "math"], "--group-rm"),
    ],
)
def test_bad_reward_config_fails_at_start(flags, message):
    with pytest.raises(MillstreamError, match=message):
        Rewarder(make_cfg(*flags))


def test_no_reward_configured_fails_the_group_with_a_hint():
    [out], _ = score(make_cfg("--reward-retries", "0"), make_group(["4"]))
    assert out.verdict == Verdict.VERDICT_FAILED and "--rm-type or --custom-rm-path" in out.reason
