"""A crashing plugin fails fast and loud, through a real `millstream train`: a reward that
raises, a per-sample generate function that raises, a dynamic-sampling filter that returns
the wrong type. Each run exits 1 within seconds of its first group, the plugin's traceback
(with its path) on the trainer's console, first when it is first seen and again as the last
thing printed; summary.json names the plugin and the error, and every admitted group is in a
terminal state or in flight. The pieces without services: tests/unit/trainer/observe/test_plugin_errors.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import crashing_plugins
from tests.support.tiny_job import job_flags, write_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TERMINAL = ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end")
PLUGINS = "tests.support.crashing_plugins"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl")


def _train(model: Path, prompts: Path, run_dir: Path, *extra: str) -> tuple[int, str, float]:
    flags = job_flags(model, prompts, run_dir, "--num-rollout", "3", *extra, rm_type=None)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "train", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=150,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return proc.returncode, proc.stdout, time.monotonic() - started


def _check(code: int, out: str, run_dir: Path, flag: str, fn: str, service: str, error: str):
    """Exit 1; the traceback printed when first seen and again last; the summary says so. A
    wrong answer (found by millstream, not raised in the plugin) has no frames to show."""
    path = f"{PLUGINS}.{fn}"
    raised = not error.startswith("TypeError: the dynamic-sampling filter returned")
    traceback = f'Traceback (most recent call last):\n  File "{crashing_plugins.__file__}"'
    assert code == 1, out[-4000:]
    first = out.find(f"plugin {flag} {path} raised in {service}:\n")
    assert first >= 0, out[-4000:]
    assert (traceback in out[first:]) == raised and error in out[first:], out[-4000:]
    ended = out.rfind("[trainer] ended: plugin failed: ")
    error_line = out.rfind("millstream train: error: ")
    assert first < ended < error_line, out[-4000:]
    last = out[error_line:]
    assert f"plugin {flag} {path} raised in {service}:" in last and error in last
    assert (traceback in last) == raised, last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 1 and summary["ended"].startswith("plugin failed: "), summary
    assert f"{service}: {flag} {path} raised" in summary["ended"] and error in summary["ended"]
    c = summary["counts"]
    assert c["admitted"] == sum(c[k] for k in TERMINAL) + c["in_flight"], c
    assert c["trained"] == 0 and c["failed"] >= 1, c
    return summary


def test_a_raising_reward_stops_the_run_at_the_default_limit(tiny_model_dir, prompts, tmp_path):
    """--custom-rm-path raises on every sample: no retry; after 32 (the default
    --max-consecutive-failed-groups) failed groups the run stops."""
    run_dir = tmp_path / "crash-reward"
    code, out, seconds = _train(
        tiny_model_dir, prompts, run_dir, "--custom-rm-path", f"{PLUGINS}.raising_reward",
        "--reward-retries", "3",  # never used on a bug
    )  # fmt: skip
    summary = _check(
        code, out, run_dir, "--custom-rm-path", "raising_reward", "reward",
        f"LookupError: {crashing_plugins.REWARD_MESSAGE}",
    )  # fmt: skip
    assert "32 groups in a row failed" in summary["ended"] and summary["counts"]["failed"] >= 32
    assert out.count("Traceback (most recent call last):") == 2, out[-6000:]  # first + last
    assert seconds < 90, seconds


def test_a_raising_generate_function_stops_the_run(tiny_model_dir, prompts, tmp_path):
    run_dir = tmp_path / "crash-generate"
    code, out, seconds = _train(
        tiny_model_dir, prompts, run_dir, "--rm-type", "exact",
        "--custom-generate-function-path", f"{PLUGINS}.raising_generate",
        "--max-consecutive-failed-groups", "4",
    )  # fmt: skip
    summary = _check(
        code, out, run_dir, "--custom-generate-function-path", "raising_generate", "rollout",
        f"ValueError: {crashing_plugins.GENERATE_MESSAGE}",
    )  # fmt: skip
    assert "4 groups in a row failed" in summary["ended"]
    assert "in _schedule" in out  # the plugin's helper frame is in the traceback
    assert seconds < 60, seconds


def test_a_filter_returning_the_wrong_type_stops_the_run(tiny_model_dir, prompts, tmp_path):
    run_dir = tmp_path / "crash-filter"
    code, out, seconds = _train(
        tiny_model_dir, prompts, run_dir, "--rm-type", "exact",
        "--dynamic-sampling-filter-path", f"{PLUGINS}.filter_returns_a_string",
        "--max-consecutive-failed-groups", "4",
    )  # fmt: skip
    code_ok = "TypeError: the dynamic-sampling filter returned 'keep' (str)"
    summary = _check(
        code, out, run_dir, "--dynamic-sampling-filter-path", "filter_returns_a_string",
        "reward", code_ok,
    )  # fmt: skip
    assert "4 groups in a row failed" in summary["ended"]
    assert seconds < 60, seconds
