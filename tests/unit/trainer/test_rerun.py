"""A finished run stays finished and nothing deletes a run's files: examples/arith/run.sh started
again on a RUN_DIR whose run finished says so and exits 0, before anything starts (a second
`docker compose up` restarts the exited trainer); a fresh start moves whatever else RUN_DIR
holds aside, never deletes it; RERUN=1 runs a finished run again. `millstream train` checks a
finished --run-dir on its own (trainer/observe/finished.py). The real runs, twice in one RUN_DIR:
tests/e2e/test_rerun.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.common.config import parse_run_config
from millstream.common.config import store as config_store
from millstream.trainer.observe.finished import finished_line

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "arith" / "run.sh"
RECORD = "printf '%s\\0' \"$@\""  # the trainer's command line on stdout, NUL-separated


def _earlier_run(run_dir: Path, ended: str | None, run_id: str = "arith") -> None:
    """RUN_DIR as a run left it: a checkpoint, metrics, its config, and a summary that says
    how it ended (None: no summary, a run killed before it could write one)."""
    (run_dir / "ckpt" / "iter_0000002").mkdir(parents=True)
    (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    cfg = parse_run_config(["--rollout-batch-size", "1", "--run-id", run_id])
    config_store.write_file(cfg, run_dir)
    if ended is not None:
        summary = {"ended": ended, "exit_code": 0, "iteration": 2, "num_rollout": 2}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def _run_sh(tmp_path: Path, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    recorder = tmp_path / "bin" / "millstream"
    recorder.parent.mkdir(exist_ok=True)
    recorder.write_text(f"#!/bin/sh\n{RECORD}\n")
    recorder.chmod(0o755)
    return subprocess.run(
        ["bash", str(SCRIPT), *flags],
        env={**os.environ, "MILLSTREAM": str(recorder), "RUN_DIR": str(tmp_path / "run"),
             "MODE": "train", "COLOCATE": "0", **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _files(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): p.read_text() for p in directory.rglob("*") if p.is_file()
    }


def test_a_finished_run_started_again_says_so_and_exits_0_touching_nothing(tmp_path):
    """What a second `docker compose up` does to the trainer's container: run.sh used to
    delete the finished run's files and train it again."""
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, "finished")
    before = _files(run_dir)
    out = _run_sh(tmp_path)
    assert out.returncode == 0 and out.stdout == "", out  # no trainer started
    (line,) = out.stderr.splitlines()
    assert line.startswith(f"[run.sh] the run in {run_dir} finished at "), line
    assert f"(summary: {run_dir / 'summary.json'})" in line and "RERUN=1 runs it again" in line
    assert _files(run_dir) == before and not list(tmp_path.glob("run.prev-*"))


@pytest.mark.parametrize(
    ("ended", "env", "said"),
    [
        ("finished", {"RERUN": "1"}, "ended: finished"),
        ("signal SIGTERM", {}, "ended: signal SIGTERM"),
        (None, {}, "no summary.json"),
    ],
)
def test_a_fresh_start_moves_the_earlier_run_aside_whole(tmp_path, ended, env, said):
    """RERUN=1 on a finished run, or an unfinished run (its checkpoints too): moved to
    RUN_DIR.prev-<time>, and the trainer starts in an empty RUN_DIR."""
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, ended)
    before = _files(run_dir)
    out = _run_sh(tmp_path, **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\0")[0] == "train"  # the trainer started
    (prev,) = tmp_path.glob("run.prev-*")
    assert _files(prev) == before and not run_dir.exists()
    assert f"[run.sh] {run_dir} held an earlier run ({said}): moved to {prev}" in out.stderr


def test_a_resume_uses_the_run_dir_as_it_is_and_the_trainer_decides(tmp_path):
    """--load: run.sh moves nothing, finished or not; the trainer's own check says whether
    there is anything left to train (below)."""
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, "finished")
    before = _files(run_dir)
    out = _run_sh(tmp_path, "--load", str(run_dir / "ckpt"))
    assert out.returncode == 0 and out.stdout.split("\0")[0] == "train", out.stderr
    assert _files(run_dir) == before and not list(tmp_path.glob("run.prev-*"))


# -- the trainer's own check ---------------------------------------------------------------------


def _cfg(run_dir: Path, *flags: str, run_id: str = "arith"):
    argv = ["--rollout-batch-size", "1", "--run-id", run_id, "--run-dir", str(run_dir), *flags]
    return parse_run_config(argv)


def test_the_trainer_names_a_finished_run_and_how_to_run_it_again(tmp_path, monkeypatch):
    monkeypatch.delenv("RERUN", raising=False)
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, "finished")
    line = finished_line(_cfg(run_dir))
    assert line is not None and line.startswith("[trainer] run arith finished at "), line
    assert f"summary {run_dir / 'summary.json'}" in line and "RERUN=1" in line
    assert "iteration 2 of 2" in line
    # Nothing left to train from its checkpoint either: the same line.
    assert finished_line(_cfg(run_dir, "--load", str(run_dir / "ckpt"))) == line


def test_the_trainer_trains_when_asked_or_when_it_is_not_the_same_finished_run(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("RERUN", raising=False)
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, "finished")
    assert finished_line(_cfg(run_dir, run_id="another")) is None  # another run's dir
    more = ("--load", str(run_dir / "ckpt"), "--num-rollout", "5")
    assert finished_line(_cfg(run_dir, *more)) is None  # trains on from its checkpoint
    assert finished_line(_cfg(tmp_path / "empty")) is None
    monkeypatch.setenv("RERUN", "0")
    assert finished_line(_cfg(run_dir)) is not None
    monkeypatch.setenv("RERUN", "1")
    assert finished_line(_cfg(run_dir)) is None
    assert "[trainer] RERUN=1: training run arith again" in capsys.readouterr().out
    monkeypatch.delenv("RERUN")
    (run_dir / "summary.json").write_text(json.dumps({"ended": "signal SIGTERM"}))
    assert finished_line(_cfg(run_dir)) is None  # unfinished: a start resumes or reruns it


def test_millstream_train_on_a_finished_run_exits_0_with_one_line(tmp_path):
    """Before preflight and before anything starts: a Miles launch script of one's own,
    started again, gets the line too (the flags need not name a model or data)."""
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, "finished")
    env = {k: v for k, v in os.environ.items() if k != "RERUN"}
    out = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "train", "--rollout-batch-size", "1",
         "--run-id", "arith", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = out.stdout.splitlines()
    assert line.startswith("[trainer] run arith finished at "), out.stdout
