"""Every way a real run ends leaves RUN_DIR/summary.json saying how: a trainer SIGKILLed and
resumed (its metrics.jsonl marks the resume and what the discarded iterations trained), then
stopped with SIGTERM (it checkpoints its last iteration first); a stall; an error raised in the
trainer. The pieces without services: tests/unit/trainer/test_run_end.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.trainer.observe import history
from tests.support.tiny_job import job_flags, write_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TERMINAL = ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl")


def _flags(model: Path, prompts: Path, run_dir: Path, *extra: str) -> list[str]:
    return job_flags(
        model, prompts, run_dir, "--rollout-temperature", "1.0", "--lr", "1e-3", *extra
    )


def _start(command: str, flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "millstream.cli", command, *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _until(trainer: subprocess.Popen, prefix: str, lines: list[str]) -> None:
    for line in trainer.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"the trainer ended before {prefix!r}:\n{''.join(lines)[-4000:]}")


def _finish(trainer: subprocess.Popen, lines: list[str]) -> int:
    lines += trainer.stdout.read().splitlines(keepends=True)  # type: ignore[union-attr]
    code = trainer.wait(timeout=120)
    trainer.stdout.close()  # type: ignore[union-attr]
    return code


def _summary(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    c = summary["counts"]
    assert c["admitted"] == sum(c[k] for k in TERMINAL) + c["in_flight"], c
    assert len(summary["in_flight_ids"]) == c["in_flight"], summary
    return summary


def test_a_killed_trainer_resumes_marked_and_a_sigterm_checkpoints_first(
    tiny_model_dir, prompts, tmp_path
):
    """SIGKILL after iteration 3 (checkpoints every 2): the resumed trainer writes the resume
    row naming what the killed one trained after the checkpoint, trains those iterations
    again, and, sent SIGTERM, finishes the iteration under way, checkpoints it (no interval
    would have: --save-interval 100), writes its summary and exits 130."""
    run_dir, ckpt = tmp_path / "run-resume", tmp_path / "ckpt"
    flags = _flags(tiny_model_dir, prompts, run_dir, "--num-rollout", "40", "--save", str(ckpt))
    first, lines = _start("train", [*flags, "--save-interval", "2"]), []
    try:
        _until(first, "[trainer] iter 3/", lines)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
        first.stdout.close()  # type: ignore[union-attr]
    (instance,) = re.findall(r"instance (\w+): a fresh start", "".join(lines))
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    killed_steps = [row["step"] for row in history.read(run_dir / "metrics.jsonl").rows]
    assert saved >= 2 and saved % 2 == 0 and killed_steps[:3] == [1, 2, 3]
    discarded = [s for s in killed_steps if s > saved]

    resumed, lines = _start("train", [*flags, "--save-interval", "100", "--load", str(ckpt)]), []
    try:
        _until(resumed, f"[trainer] iter {saved + 2}/", lines)
        resumed.send_signal(signal.SIGTERM)
        code = _finish(resumed, lines)
    finally:
        if resumed.poll() is None:
            resumed.kill()
    out = "".join(lines)
    assert code == 130 and "interrupted" in out, out[-4000:]
    assert "[trainer] SIGTERM: stopping after the iteration under way" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    # The groups the killed trainer admitted are this run's too: the same instance.
    assert f"instance {instance}: resumed" in out
    summary = _summary(run_dir)
    assert (summary["ended"], summary["exit_code"]) == ("signal SIGTERM", 130)
    assert summary["counts"]["earlier_run_dropped"] == 0
    # The last finished iteration is checkpointed, and it is the last one logged.
    last = summary["iteration"]
    h = history.read(run_dir / "metrics.jsonl")
    assert last >= saved + 2 and summary["checkpoint"] == last == h.rows[-1]["step"], summary
    state = json.loads((ckpt / f"iter_{last:07d}" / "trainer_state.json").read_text())
    assert state["iteration"] == last and state["counts"]["trained"] == 2 * last
    assert f"saved checkpoint {ckpt}/iter_{last:07d}" in out
    # metrics.jsonl: the resume row, between the killed trainer's rows and the resumed one's.
    raw = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    marks = [i for i, row in enumerate(raw) if "resumed_from" in row]
    assert len(marks) == 1 and [r["step"] for r in raw[: marks[0]]] == killed_steps
    mark = {k: v for k, v in raw[marks[0]].items() if k != "time"}
    assert mark == {
        "resumed_from": saved,
        "discarded_iterations": discarded,
        "discarded_trained": 2 * len(discarded),
    }
    assert raw[marks[0] + 1]["step"] == saved + 1
    assert summary["resumes"] == [mark]
    # As the run stands, every iteration once and no group trained twice.
    assert [row["step"] for row in h.rows] == list(range(1, last + 1))
    trained = [gid for row in h.rows for gid in row["group_ids"]]
    assert len(trained) == len(set(trained)) == summary["counts"]["trained"]


def test_a_stall_ends_the_run_with_a_summary_that_says_so(
    tiny_model_dir, prompts, tmp_path, redis_url
):
    """Redis, an engine and a router, but no rollout or reward worker: the first batch wait
    fails after --stall-timeout, and the summary says why, with the groups left in flight."""
    from tests.support.engine_proc import EngineProcess
    from tests.support.router_proc import start_router

    run_dir = tmp_path / "run-stall"
    engine = EngineProcess(tiny_model_dir, tmp_path, "--weight-version", "0")
    router = start_router(tmp_path, "--worker-urls", engine.url)
    try:
        flags = _flags(
            tiny_model_dir, prompts, run_dir, "--num-rollout", "3", "--redis-url", redis_url,
            "--router-url", router.url, "--stall-timeout", "2",
        )  # fmt: skip
        trainer, lines = _start("train", flags), []
        code = _finish(trainer, lines)
    finally:
        router.stop()
        engine.stop()
    out = "".join(lines)
    assert code == 1, out[-4000:]
    summary = _summary(run_dir)
    assert summary["ended"].startswith("stall timeout: waited "), summary
    assert "no rollout worker is alive" in summary["ended"] and summary["exit_code"] == 1
    assert summary["counts"]["trained"] == 0 and summary["counts"]["in_flight"] >= 2
    assert f"[trainer] ended: {summary['ended']} (exit code 1)" in out


def test_an_error_in_the_trainer_ends_the_run_with_a_summary_that_names_it(
    tiny_model_dir, prompts, tmp_path
):
    """The custom rollout log function raises after iteration 1: the run fails (exit 1) and
    the summary names the error, with the counts of what it trained by then."""
    run_dir = tmp_path / "run-error"
    flags = _flags(
        tiny_model_dir, prompts, run_dir, "--num-rollout", "3",
        "--custom-rollout-log-function-path", "tests.support.log_plugins.raising_rollout",
    )  # fmt: skip
    trainer, lines = _start("train", flags), []
    code = _finish(trainer, lines)
    out = "".join(lines)
    assert code == 1 and "millstream train: error: " in out, out[-4000:]
    summary = _summary(run_dir)
    assert summary["ended"] == (
        "error: MillstreamError: --custom-rollout-log-function-path "
        "'tests.support.log_plugins.raising_rollout' raised ValueError: statsd is down"
    ), summary
    assert summary["exit_code"] == 1 and summary["iteration"] == 1
    assert summary["counts"]["trained"] == 2
