"""The services started one by one, as `docker compose up` starts them, on loopback.

A router with no engine; the trainer given --redis-url and --router-url (so it starts
nothing) and a fixed --coordinator-port; rollout and reward workers given only --redis-url
and --run-id; an engine given --coordinator, which asks the trainer to join. The trainer
syncs it in before the first rollout; a second engine joins mid-run and must serve the
final weights too. Every admitted group ends in one terminal state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.redis_server import free_port
from tests.support.router_proc import ServiceProcess, start_router
from tests.support.worker_procs import WorkerProcs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 120  # ~0.1-0.3 s each: time for an engine started at iteration 2 to boot and join


def engine(model: Path, workdir: Path, coordinator: str) -> ServiceProcess:
    args = ["--model-path", str(model), "--num-threads", "1", "--weight-version", "0"]
    return ServiceProcess("engine", [*args, "--coordinator", coordinator], workdir)


@pytest.mark.long  # joins through the Coordinator: every chaos test's deployment
def test_engines_join_through_the_coordinator_before_and_during_a_run(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(20))
    )
    run_id, port = "deploy", free_port()
    router = start_router(tmp_path)
    workers = WorkerProcs(redis_url, run_id, tmp_path)
    first = second = None
    trainer_log = tmp_path / "trainer.log"
    argv = [
        sys.executable, "-m", "millstream.cli", "train",
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--num-rollout", str(ITERATIONS),
        "--redis-url", redis_url, "--router-url", router.url, "--run-id", run_id,
        "--coordinator-port", str(port), "--run-dir", str(tmp_path / "run"),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with trainer_log.open("w") as log:
        trainer = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        workers.spawn("rollout", "rollout-0", [])
        workers.spawn("reward", "reward-0", [])
        first = engine(tiny_model_dir, tmp_path, f"127.0.0.1:{port}")
        # The second engine starts once training is under way, and joins at a later sync.
        deadline = time.monotonic() + 120
        while "[trainer] iter 2/" not in trainer_log.read_text():
            assert trainer.poll() is None and time.monotonic() < deadline, trainer_log.read_text()
            time.sleep(0.1)
        assert "coordinator (gRPC) at " in trainer_log.read_text()
        # ITERATIONS leave the run time for the second engine's boot (~5 s on 2 cores).
        second = engine(tiny_model_dir, tmp_path, f"127.0.0.1:{port}")
        assert trainer.wait(timeout=180) == 0, trainer_log.read_text()[-3000:]
        text = trainer_log.read_text()
        listed = httpx.get(f"{router.url}/list_workers").json()["urls"]
        assert sorted(listed) == sorted([first.url, second.url]), text
        for url in (first.url, second.url):
            version = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
            assert version == str(ITERATIONS), (url, version)
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        counts = summary["counts"]
        terminal = sum(counts[k] for k in ("trained", "filtered", "failed", "dropped_stale"))
        assert counts["admitted"] == terminal + counts["dropped_at_end"], counts
        assert counts["trained"] == 2 * ITERATIONS and counts["in_flight_lost"] == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for name in list(workers.procs):
            workers.kill(name)
        for proc in (first, second):
            if proc is not None:
                proc.stop()
        router.stop()
