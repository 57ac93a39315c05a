"""FP8 rollout, Miles' "BF16 train + FP8 inference": `make run`'s arith job with the engine on an
FP8 copy of the model (--hf-checkpoint, examples/arith/make_fp8.py) and the trainer on the
full-precision weights (--ref-load), corrected by --use-tis (run.sh has it). Ten rollouts,
strictly on-policy: it learns, every step has a gradient, and the rollout log-probs are FP8's
(the trainer's recomputed ones differ from them by ~0.008 nats a token; 2e-7 without FP8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.engine.quant.test_fp8 import ARITH, make_fp8_copy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = ARITH / "run.sh"


def test_the_arith_job_learns_with_fp8_rollout(tmp_path):
    fp8_dir = make_fp8_copy(tmp_path / "model-fp8")
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        "RUN_DIR": str(run_dir),
        "NUM_ROLLOUT": "10",
        "MODE": "train",
    }
    flags = ["--hf-checkpoint", str(fp8_dir), "--ref-load", str(ARITH / "model"),
             "--eval-interval", "10", "--save-interval", "10"]  # fmt: skip
    proc = subprocess.run(
        ["bash", str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert f"--model-path {fp8_dir} " in engine_log
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = {it: acc["arith"] for it, _, acc in summary["eval_curve"]}
    assert sorted(curve) == [0, 10], curve
    assert curve[10] >= curve[0] + 0.15, curve  # measured 31.5% -> 62.0% (fp32 rollout: 70%)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and all(r["grad_norm"] > 0 for r in rows)
    gaps = [r["train_rollout_logprob_abs_diff"] for r in rows]
    print(f"|train - rollout| log-prob per token: mean {sum(gaps) / len(gaps):.4f}, "
          f"steps {min(gaps):.4f}..{max(gaps):.4f}")  # fmt: skip
    assert all(1e-3 < gap < 0.05 for gap in gaps), gaps  # measured 0.005-0.012
    from safetensors import safe_open

    saved = run_dir / "ckpt" / "iter_0000010" / "model"
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    with safe_open(str(saved / "model.safetensors"), "pt") as f:  # the actor: full precision
        names = f.keys()
        assert {f.get_tensor(k).dtype for k in names} == {torch.float32}
