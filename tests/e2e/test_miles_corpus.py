"""Plugins in Miles' shapes (tests/support/miles_corpus.py) through one real training run.

One `train-async` through every service with Miles' own data source class, a multi-turn
tool-calling generate function on `GenerateState`, a reward on `rm_hub`'s graders reading a
dict label, a custom TIS function and a rollout log function, all at once: the run trains,
every admitted group ends in one terminal state, and what each plugin did shows in what the
run left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CORPUS = "tests.support.miles_corpus"


def test_miles_shaped_plugins_train_together(tiny_model_dir, tmp_path):
    data = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": f"{i}+{i + 1}=", "label": {"ground_truth": str(2 * i + 1)}} for i in range(24)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    flags = [
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data),
        "--input-key", "prompt", "--label-key", "label",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "3",
        "--rollout-max-response-len", "3", "--rollout-temperature", "1.0", "--lr", "1e-3",
        "--run-dir", str(run_dir), "--run-id", "corpus", "--log-level", "warning",
        "--num-rollout-workers", "1", "--num-reward-workers", "1", "--max-staleness", "1",
        "--data-source-path", "miles.rollout.data_source.RolloutDataSourceWithBuffer",
        "--custom-generate-function-path", f"{CORPUS}.generate_with_calculator",
        "--custom-rm-path", f"{CORPUS}.calculator_reward",
        "--use-tis", "--custom-tis-function-path", f"{CORPUS}.clipped_tis",
        "--custom-rollout-log-function-path", f"{CORPUS}.log_rollout_data",
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "train-async", *flags],
        capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    c = json.loads((run_dir / "summary.json").read_text())["counts"]
    terminal = c["trained"] + c["filtered"] + c["failed"] + c["dropped_stale"]
    assert c["admitted"] == terminal + c["dropped_at_end"] and c["in_flight_lost"] == 0
    assert c["trained"] == 6 and c["failed"] == 0

    # The log function saw the dict labels, both turns, and the tool's tokens out of the loss.
    logged = [json.loads(x) for x in (run_dir / "corpus_log.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in logged] == [0, 1, 2]
    samples = [s for r in logged for s in r["samples"]]
    assert len(samples) == 12
    truths = {r["label"]["ground_truth"] for r in rows}
    for s in samples:
        assert isinstance(s["label"], dict) and s["label"]["ground_truth"] in truths
        assert s["turns"] == 2 and 0 in s["loss_mask"] and 1 in s["loss_mask"]
        assert len(s["loss_mask"]) == s["response_length"]

    # The custom TIS function ran in the loss: its metric is in every training row, and the
    # run trained (rewards differ inside groups).
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3 and any(r["grad_norm"] > 0 for r in steps)
    assert all(
        r["train/custom_tis"] > 0 and 0 <= r["train/custom_tis_clipfrac"] <= 1 for r in steps
    )
    # The log function's tracking.log (Miles' metric_utils) landed in the rows.
    mean_lengths = [r["rollout/response_len/mean"] for r in steps]
    assert all(0 < m <= 3 + 16 for m in mean_lengths) and all("passrate/pass@2" in r for r in steps)
