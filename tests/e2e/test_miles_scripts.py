"""examples/miles_compat's runnable launch scripts, each run for real for one iteration (about
6 s each on an idle 2-core machine: one rollout, and the eval the script asks for on a
16-problem slice of its eval set). Their flags and preflight, in-process:
tests/unit/compat/test_miles_compat.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.trainer import preflight
from millstream.trainer.checkpoints import megatron_ckpt
from tests.unit.compat.test_miles_compat import GPU_NODE, MILES, REPO, RUNNABLE

# The estimators these scripts choose train in tests/e2e/test_estimators.py (make test).
LONG_SCRIPTS = ("run-dapo.sh", "run-gspo.sh", "run-ppo.sh", "run-opd.sh")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.long) if n in LONG_SCRIPTS else n
        for n in RUNNABLE + list(GPU_NODE)
    ],
)
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_runnable_scripts_train_one_iteration_on_cpu(tmp_path, name):
    """The script as shipped, with only the paths (RUN_DIR, EVAL_DATA: a slice of the arith
    eval set, to keep it short) and the length (NUM_ROLLOUT) given through the environment
    (and CPU_ONLY=1 for a GPU node's: the same arrays, placed on the CPU); the checkpoint it
    saves is ours and --load reads it back."""
    run_dir = tmp_path / "run"
    eval_data = tmp_path / "eval.jsonl"
    rows = (REPO / "examples" / "arith" / "data" / "eval.jsonl").read_text().splitlines()
    eval_data.write_text("\n".join(rows[:16]) + "\n")
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        "RUN_DIR": str(run_dir),
        "EVAL_DATA": str(eval_data),
        "NUM_ROLLOUT": "1",
        "CPU_ONLY": "1",
    }
    proc = subprocess.run(
        ["bash", str(MILES / name)], env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[trainer] iter 1/1 | loss=" in proc.stdout, proc.stdout[-3000:]
    counts = json.loads((run_dir / "summary.json").read_text())["counts"]
    assert counts["trained"] >= 8 and counts["in_flight_lost"] == 0
    ckpt = run_dir / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert megatron_ckpt.describe(ckpt) is None
    preflight._check_load(str(ckpt))
