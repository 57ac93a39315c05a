"""examples/arith/run.sh three times in one RUN_DIR, as a second and a third `docker compose up`
start the trainer's container again: a short real run; then the same command, which says the
run finished and exits 0 at once, its files as they were; then RERUN=1, which moves them aside
whole and trains a new run. The pieces, with a recorder in millstream's place:
tests/unit/trainer/test_rerun.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "arith" / "run.sh"


def _run_sh(run_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    env = {
        **{k: v for k, v in os.environ.items() if k != "RERUN"},
        "PYTHONUNBUFFERED": "1",
        "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        "RUN_DIR": str(run_dir), "NUM_ROLLOUT": "2", "MODE": "train", "COLOCATE": "0", **env,
    }  # fmt: skip
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=180
    )


def _files(directory: Path) -> dict[str, tuple[int, bytes]]:
    """Each file's modification time and bytes (traces and logs included)."""
    return {
        str(p.relative_to(directory)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in directory.rglob("*")
        if p.is_file()
    }


def test_a_finished_run_started_again_stays_finished_unless_rerun(tmp_path):
    run_dir = tmp_path / "arith"
    first = _run_sh(run_dir)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["ended"], summary["iteration"], summary["checkpoint"]) == ("finished", 2, 2)
    before = _files(run_dir)

    start = time.monotonic()
    again = _run_sh(run_dir)
    took = time.monotonic() - start
    assert again.returncode == 0 and again.stdout == "", again.stderr[-4000:]
    (line,) = again.stderr.splitlines()
    assert line.startswith(f"[run.sh] the run in {run_dir} finished at "), line
    assert took < 10, took  # before anything starts (not even `millstream gpus`)
    assert _files(run_dir) == before and not list(tmp_path.glob("arith.prev-*"))

    rerun = _run_sh(run_dir, RERUN="1")
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    (prev,) = tmp_path.glob("arith.prev-*")
    assert _files(prev) == before  # moved, not rewritten
    assert f"held an earlier run (ended: finished): moved to {prev}" in rerun.stderr
    again_summary = json.loads((run_dir / "summary.json").read_text())
    assert again_summary["ended"] == "finished" and again_summary["resumes"] == []
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2]  # a new run, not appended to the old
