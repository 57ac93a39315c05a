"""`make run`'s arith job with --bf16 (the torch backend's bf16 weights and activations, fp32
masters): it learns as the fp32 job does. Ten rollouts of the shipped script, strictly on-policy;
the fp32 job goes from 31% to 70% greedy accuracy by then (docs/benchmarks.md's curve)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "arith" / "run.sh"


def test_the_arith_job_learns_in_bf16(tmp_path):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        "RUN_DIR": str(run_dir),
        "NUM_ROLLOUT": "10",
        "MODE": "train",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--bf16", "--eval-interval", "10", "--save-interval", "10"],
        env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = {it: acc["arith"] for it, _, acc in summary["eval_curve"]}
    assert sorted(curve) == [0, 10], curve
    assert curve[10] >= curve[0] + 0.15, curve  # learned: fp32 gains ~39 points by rollout 10
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0 for r in rows)
    from safetensors import safe_open

    saved = run_dir / "ckpt" / "iter_0000010" / "model" / "model.safetensors"
    with safe_open(str(saved), "pt") as f:  # the engines' weights: bf16
        names = f.keys()
        assert {f.get_tensor(k).dtype for k in names} == {torch.bfloat16}
