"""A crashing plugin fails its group at once with its traceback, never a retry or a redelivery
(common/plugin_errors.py), and the trainer prints it once and stops after N such groups in a
row (trainer/observe/plugin_failures.py). Infrastructure failures keep their retries. Without servers;
the whole run: tests/e2e/test_plugin_crash.py."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from millstream.common.errors import MillstreamError
from millstream.common.plugin_errors import (
    MAX_TRACEBACK_CHARS,
    PluginFailed,
    describe,
    error_key,
    find,
    is_infrastructure,
    plugin_error,
)
from millstream.common.types import PluginError, ScoredGroup, Verdict
from millstream.reward.celery_app import CeleryExecutor, CeleryRuntime
from millstream.rollout.client import GenerationFailed
from millstream.trainer.observe.plugin_failures import PluginCrashed, PluginFailures
from millstream.trainer.observe.summary import ended_by
from tests.support import crashing_plugins
from tests.unit.reward.test_reward_scorer import make_cfg, make_group, score
from tests.unit.rollout.test_rollout_flow import FakeEngine, prompt_group, run_worker

CRASHING = "tests.support.crashing_plugins"


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as err:
        return err
    raise AssertionError("did not raise")


# -- the error itself -----------------------------------------------------------------------------


def test_the_traceback_starts_at_the_plugin_and_the_reason_names_it():
    def caller():  # millstream's frames above the plugin: cut
        return crashing_plugins.raising_reward(None, None)

    err = _raised(caller)
    error = plugin_error(err, "--custom-rm-path", f"{CRASHING}.raising_reward", "reward")
    lines = error.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "crashing_plugins.py" in lines[1] and "in raising_reward" in lines[1]
    assert "in _lookup" in error.traceback and "caller" not in error.traceback
    assert lines[-1] == f"LookupError: {crashing_plugins.REWARD_MESSAGE}"
    assert describe(error) == (
        f"reward: --custom-rm-path {CRASHING}.raising_reward raised LookupError: "
        f"{crashing_plugins.REWARD_MESSAGE}"
    )
    assert error_key(error) == (
        "--custom-rm-path", f"{CRASHING}.raising_reward", "LookupError",
        crashing_plugins.REWARD_MESSAGE,
    )  # fmt: skip
    # An error found by the caller (a wrong return value) keeps all of its short traceback.
    wrong = plugin_error(TypeError("returned 3"), "--f", "m.f", "reward")
    assert wrong.traceback == "TypeError: returned 3\n"


def test_a_huge_traceback_and_message_are_cut():
    def deep(n):
        if n == 0:
            raise ValueError("x" * 20_000)
        deep(n - 1)

    error = plugin_error(_raised(deep, 400), "--f", "no.such.fn", "rollout")
    assert len(error.traceback) < MAX_TRACEBACK_CHARS + 100 and "characters cut" in error.traceback
    assert error.traceback.startswith("Traceback") and error.traceback.rstrip().endswith("xxx")
    assert len(error.message) < 2100 and error.message.endswith(" ...")


def test_infrastructure_failures_are_told_apart_from_plugin_bugs():
    infra = [
        ConnectionError("refused"), TimeoutError(), httpx.ConnectError("down"),
        GenerationFailed("router gone"), MillstreamError("ours"),
        ExceptionGroup("g", [TimeoutError(), ConnectionResetError()]),
    ]  # fmt: skip
    bugs = [ValueError("x"), KeyError("k"), ExceptionGroup("g", [TimeoutError(), ValueError()])]
    assert all(is_infrastructure(e) for e in infra)
    assert not any(is_infrastructure(e) for e in bugs)
    failed = PluginFailed(PluginError(flag="--f", path="m.f", type="E", message="m"))
    assert find(ExceptionGroup("g", [ValueError(), ExceptionGroup("h", [failed])])) is failed


def test_a_plugin_error_crosses_celery_as_json():
    failed = PluginFailed(plugin_error(ValueError("bad"), "--custom-rm-path", "m.f", "reward"))
    back = PluginFailed.from_json(json.loads(json.dumps(failed.to_json())))
    assert back is not None and back.error == failed.error and str(back) == str(failed)
    assert PluginFailed.from_json(0.5) is None and PluginFailed.from_json([1.0]) is None


# -- reward ---------------------------------------------------------------------------------------


def test_a_raising_reward_is_not_retried_a_refused_verifier_is():
    cfg = make_cfg(
        "--custom-rm-path", f"{CRASHING}.raising_reward", "--reward-retries", "3"
    )  # fmt: skip
    [out], stats = score(cfg, make_group(["4", "5"]))
    assert out.verdict == Verdict.VERDICT_FAILED and out.plugin_error.type == "LookupError"
    assert stats["reward_retries"] == 0 and stats["reward_plugin_errors"] >= 1
    cfg = make_cfg(
        "--custom-rm-path", f"{CRASHING}.unreachable_verifier", "--reward-retries", "1"
    )  # fmt: skip
    [out], stats = score(cfg, make_group(["4"]))
    assert out.verdict == Verdict.VERDICT_FAILED and not out.HasField("plugin_error")
    assert "ConnectionError" in out.reason and stats["reward_retries"] == 1


def test_a_filter_returning_the_wrong_type_fails_the_group_naming_what_it_returned():
    path = f"{CRASHING}.filter_returns_a_string"
    cfg = make_cfg("--rm-type", "exact", "--dynamic-sampling-filter-path", path)
    [out], _ = score(cfg, make_group(["4", "5"]))
    assert out.verdict == Verdict.VERDICT_FAILED
    assert out.reason.startswith(
        f"reward: --dynamic-sampling-filter-path {path} raised TypeError: the dynamic-sampling "
        "filter returned 'keep' (str)"
    )
    assert out.plugin_error.flag == "--dynamic-sampling-filter-path"


def test_a_group_failed_by_a_plugin_in_rollout_passes_through_with_its_error():
    cfg = make_cfg("--rm-type", "exact")
    group = make_group(["4"])
    error = plugin_error(ValueError("bug"), "--custom-generate-function-path", "m.g", "rollout")
    group.failure_reason = describe(error)
    group.plugin_error.CopyFrom(error)
    [out], _ = score(cfg, group)
    assert out.verdict == Verdict.VERDICT_FAILED and out.reason == describe(error)
    assert out.plugin_error == error


def test_celery_carries_the_plugin_error_back_to_the_scorer():
    cfg = make_cfg("--custom-rm-path", f"{CRASHING}.raising_reward")
    runtime = CeleryRuntime(cfg)
    try:
        group = make_group(["4"])
        answer = runtime.run(runtime.rewarder.sample_reward(group.samples[0], "2+2?"))
    finally:
        runtime.close()
    assert answer["plugin_error"]["service"] == "reward-celery"

    class Result:
        def get(self, timeout, interval):
            return json.loads(json.dumps(answer))  # as Celery's JSON result backend gives it

        def forget(self):
            pass

    class App:
        def send_task(self, *args, **kwargs):
            return Result()

    executor = CeleryExecutor(App(), cfg.run_id, 1.0)
    with pytest.raises(PluginFailed) as info:
        asyncio.run(executor.sample_reward(group.samples[0], "2+2?"))
    assert info.value.error.type == "LookupError"
    assert "crashing_plugins.py" in info.value.error.traceback


# -- rollout --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "fn", "type_"),
    [
        ("--custom-generate-function-path", "raising_generate", "ValueError"),
        ("--custom-generate-function-path", "generate_returns_a_dict", "TypeError"),
        ("--rollout-function-path", "raising_rollout", "RuntimeError"),
    ],
)
def test_a_crashing_rollout_plugin_fails_its_group_at_once(flag, fn, type_):
    engine = FakeEngine()
    (result,) = run_worker(engine, [prompt_group(n_samples=2)], flag, f"{CRASHING}.{fn}")
    error = result.plugin_error
    assert (error.flag, error.path, error.type, error.service) == (
        flag, f"{CRASHING}.{fn}", type_, "rollout"
    )  # fmt: skip
    assert result.failure_reason == describe(error) and not result.samples
    assert "crashing_plugins.py" in error.traceback or type_ == "TypeError"


def test_a_generate_function_that_cannot_reach_the_router_is_a_generation_failure():
    path = f"{CRASHING}.router_down_generate"
    (result,) = run_worker(FakeEngine(), [prompt_group()], "--custom-generate-function-path", path)
    assert not result.HasField("plugin_error")
    assert result.failure_reason.startswith(f"rollout: --custom-generate-function-path {path}:")
    assert "ConnectError" in result.failure_reason


@pytest.mark.parametrize("fn", ["raising_buffer_filter", "buffer_filter_returns_an_int"])
def test_a_crashing_buffer_filter_fails_the_parked_groups(fn):
    engine = FakeEngine()
    engine.aborts["g1-s0-"] = 3  # parks g1 until the sync looks over: the filter orders it
    groups = [prompt_group("g1", n_samples=1), prompt_group("g2", n_samples=1)]
    g1, g2 = run_worker(engine, groups, "--buffer-filter-path", f"{CRASHING}.{fn}")
    assert g1.plugin_error.flag == "--buffer-filter-path" and g1.plugin_error.path.endswith(fn)
    assert g2.failure_reason == "" and len(g2.samples) == 1  # never parked: never filtered


# -- trainer --------------------------------------------------------------------------------------


def _scored(error: PluginError | None = None, verdict=Verdict.VERDICT_FAILED) -> ScoredGroup:
    scored = ScoredGroup(verdict=verdict if error is None else Verdict.VERDICT_FAILED)
    if error is not None:
        scored.plugin_error.CopyFrom(error)
    return scored


def test_the_trainer_prints_each_error_once_and_stops_after_n_in_a_row(caplog):
    a = plugin_error(_raised(crashing_plugins.raising_reward, None, None),
                     "--custom-rm-path", f"{CRASHING}.raising_reward", "reward")  # fmt: skip
    b = plugin_error(
        ValueError("other"), "--custom-rm-path", f"{CRASHING}.raising_reward", "reward"
    )
    failures = PluginFailures(max_in_row=3)
    with caplog.at_level(logging.ERROR, logger="millstream.trainer"):
        for scored in (_scored(a), _scored(a), _scored(verdict=Verdict.VERDICT_KEPT)):
            failures.observe(scored)
        failures.check()  # 2 in a row, then a kept group: nothing stops
        failures.observe(_scored(b))
        failures.observe(_scored())  # failed, not by a plugin: the count starts over
        for _ in range(3):
            failures.observe(_scored(a))
    printed = [r.getMessage() for r in caplog.records]
    assert len(printed) == 2  # a and b, once each
    assert printed[0].startswith(
        f"plugin --custom-rm-path {CRASHING}.raising_reward raised in reward:\n"
        "Traceback (most recent call last):"
    )
    assert failures.total == 6
    with pytest.raises(PluginCrashed) as info:
        failures.check()
    crash = info.value
    assert crash.summary == (
        "3 groups in a row failed because a plugin raised (--max-consecutive-failed-groups 3): "
        + describe(a)
    )
    assert str(crash).endswith(a.traceback.rstrip()) and "raised in reward:" in str(crash)
    assert ended_by(crash, None) == (f"plugin failed: {crash.summary}", 1)


def test_zero_never_stops():
    failures = PluginFailures(max_in_row=0)
    for _ in range(100):
        failures.observe(_scored(plugin_error(ValueError("x"), "--f", "m.f", "reward")))
    failures.check()
    assert failures.in_row == 100
