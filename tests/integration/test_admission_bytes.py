"""--max-buffer-bytes in a real run: `millstream train-async` (the tiny model) given Redis and a
router, the real rollout and reward workers, and a simulated engine (bench/fleet_engine.py)
whose every response is 128 tokens (EOS ignored). The groups the staleness budget would let out
weigh more than the bound: admission holds back, says so, counts stay under it, and the run
finishes with every admitted group in one terminal state (nothing lost)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fleet import FleetProcess
from tests.support.router_proc import start_router
from tests.support.worker_procs import WorkerProcs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS, BATCH, N, TOKENS = 3, 4, 4, 128
BOUND = 35_000  # ~5 groups of ~6 kB (4 samples x 128 tokens); staleness 2 would let out 12


def test_admission_holds_back_for_bytes_and_loses_nothing(tiny_model_dir, redis_url, tmp_path):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(40))
    )
    # 128 tokens in ~50 ms a request: groups are out long enough to count as such.
    fleet = FleetProcess(tmp_path, 1, ["--vocab-size", str(vocab), "--decode-step-ms", "0.4"])
    router = workers = trainer = None
    run_id, run_dir = "bytes", tmp_path / "run"
    try:
        router = start_router(tmp_path, "--worker-urls", *fleet.urls)
        argv = [
            sys.executable, "-m", "millstream.cli", "train-async",
            "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact",
            "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
            "--rollout-max-response-len", str(TOKENS), "--num-rollout", str(ITERATIONS),
            "--max-staleness", "2", "--max-buffer-bytes", str(BOUND),
            "--redis-url", redis_url, "--router-url", router.url, "--run-id", run_id,
            "--run-dir", str(run_dir), "--update-weight-transport", "disk",
            "--num-threads", "1", "--log-level", "warning",
        ]  # fmt: skip
        log_path = tmp_path / "trainer.log"
        with log_path.open("w") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            trainer = subprocess.Popen(
                argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        workers = WorkerProcs(redis_url, run_id, tmp_path)
        workers.spawn("rollout", "rollout-0", ["--consumer-name", "rollout-0"])
        workers.spawn("reward", "reward-0", ["--consumer-name", "reward-0"])
        assert trainer.wait(timeout=100) == 0, log_path.read_text()[-4000:]
        text = log_path.read_text()
        summary = json.loads((run_dir / "summary.json").read_text())
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        if workers is not None:
            workers.stop_all()
        if router is not None:
            router.stop()
        fleet.stop()
    counts, held = summary["counts"], summary["buffer_bytes"]
    terminal = sum(counts[k] for k in ("trained", "filtered", "failed", "dropped_stale"))
    assert counts["admitted"] == terminal + counts["dropped_at_end"], counts
    assert counts["in_flight"] == 0 and counts["failed"] == 0, counts
    assert counts["trained"] == ITERATIONS * BATCH, counts
    assert "admission holds back for --max-buffer-bytes 35 kB: " in text, text
    assert held["holds"] >= 1 and held["limit"] == BOUND, held
    # Every group weighs what the first did: what was counted never passed the bound, and the
    # staleness budget alone would have let out more than twice as much.
    assert 4_000 < held["group_bytes"] < 10_000, held
    assert held["peak_counted"] <= BOUND, held
    assert 3 * BATCH * held["group_bytes"] > 2 * BOUND
