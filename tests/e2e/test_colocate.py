"""`make run`'s arith job with --colocate, on the CPU: every iteration the engine releases its
KV cache and weights before the trainer steps and resumes them around the weight sync, and the
trainer's state goes to host memory and back (docs/gpus.md). On the CPU nothing moves,
so what this proves is the turns themselves (the engine's own log counts them, the trainer's
record orders them), that a retracted rollout resumes, and that the job still learns, sync
and async. The turns' order alone, fast: tests/unit/trainer/test_colocate_turns.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "arith" / "run.sh"
ROLLOUTS = 8


# sync mode's turns: tests/integration/test_colocate_engine.py and the unit tests
@pytest.mark.parametrize("mode", [pytest.param("train", marks=pytest.mark.long), "train-async"])
def test_the_arith_job_learns_colocated(tmp_path, mode):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        "RUN_DIR": str(run_dir),
        "NUM_ROLLOUT": str(ROLLOUTS),
        "MODE": mode,
        "COLOCATE": "0",  # the flags below, whatever the machine
    }
    flags = ["--colocate", "--eval-interval", str(ROLLOUTS), "--log-level", "info"]
    proc = subprocess.run(
        ["bash", str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=280
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[trainer] colocated on cpu: the trainer's state goes to host memory" in out

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == ROLLOUTS
    assert all(r["grad_norm"] > 0 and r["colocate_time"] > 0 for r in rows)
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    released = re.findall(r"released \['kv_cache', 'weights'\]", engine_log)
    weights = re.findall(r"resumed \['weights'\]", engine_log)
    kv = re.findall(r"resumed \['kv_cache'\]", engine_log)
    assert len(released) == len(weights) == len(kv) == ROLLOUTS, (released, weights, kv)
    # The trainer's record of its turns (weights/colocate.py): in order every iteration, its
    # state in host memory whenever the engine holds its KV cache. (A turn out of order
    # stops the run with ColocationError: the return code above.)
    turns = re.findall(
        r"colocate turn ([a-z_ ]+): the trainer's state (on the device|in host)", out
    )
    iteration = [
        ("release", "in host"), ("onload", "on the device"), ("resume weights", "on the device"),
        ("offload", "in host"), ("resume kv_cache", "in host"),
    ]  # fmt: skip
    assert turns == [("offload", "in host"), *iteration * ROLLOUTS], turns

    summary = json.loads((run_dir / "summary.json").read_text())
    c = summary["counts"]
    assert c["admitted"] == c["trained"] + c["filtered"] + c["failed"] + sum(
        v for k, v in c.items() if k.startswith("dropped")
    ), c
    curve = {it: acc["arith"] for it, _, acc in summary["eval_curve"]}
    assert curve[ROLLOUTS] >= curve[0] + 0.15, curve  # learned, as the job does uncolocated
