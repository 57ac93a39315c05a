"""A deployment's only engine SIGKILLed mid-run and replaced.

Services started one by one as in test_deployment.py (the trainer given --redis-url and
--router-url starts none; the engine joins through the Coordinator). At iteration 3 the engine
is killed; the trainer pauses admission, says once that it waits and how to add an engine, and
a replacement started 3 s later joins, is synced to the current version before any traffic,
and the run goes on to exit 0 with every admitted group in one terminal state. (The router
restarted mid-run: tests/integration/test_engines_come_back.py, and `make chaos`.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_deployment import ROOT, engine
from tests.support.redis_server import free_port
from tests.support.router_proc import start_router
from tests.support.worker_procs import WorkerProcs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ITERATIONS = 12


def _start_trainer(model: Path, redis_url: str, router_url: str, port: int, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(20))
    )
    argv = [
        sys.executable, "-m", "millstream.cli", "train",
        "--hf-checkpoint", str(model), "--prompt-data", str(prompts),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--num-rollout", str(ITERATIONS),
        "--redis-url", redis_url, "--router-url", router_url, "--run-id", tmp_path.name,
        "--coordinator-port", str(port), "--run-dir", str(tmp_path / "run"),
        "--stall-timeout", "60", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with (tmp_path / "trainer.log").open("w") as log:
        return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_for_iteration(trainer: subprocess.Popen, log: Path, it: int) -> None:
    deadline = time.monotonic() + 120
    while f"[trainer] iter {it}/" not in log.read_text():
        assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def _check_counts(run_dir: Path) -> None:
    counts = json.loads((run_dir / "summary.json").read_text())["counts"]
    terminal = sum(counts[k] for k in ("trained", "filtered", "failed", "dropped_stale"))
    assert counts["admitted"] == terminal + counts["dropped_at_end"], counts
    assert counts["trained"] == 2 * ITERATIONS and counts["in_flight_lost"] == 0


@pytest.mark.long  # the sync's wait and the newcomer: tests/integration/test_engines_come_back.py
def test_the_only_engine_killed_mid_run_is_replaced_and_the_run_goes_on(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
):
    port = free_port()
    router = start_router(tmp_path)
    workers = WorkerProcs(redis_url, tmp_path.name, tmp_path)
    first = second = None
    trainer_log = tmp_path / "trainer.log"
    trainer = _start_trainer(tiny_model_dir, redis_url, router.url, port, tmp_path)
    try:
        workers.spawn("rollout", "rollout-0", [])
        workers.spawn("reward", "reward-0", [])
        first = engine(tiny_model_dir, tmp_path, f"127.0.0.1:{port}")
        _wait_for_iteration(trainer, trainer_log, 3)
        first.kill()
        killed = time.monotonic()
        time.sleep(3)
        second = engine(tiny_model_dir, tmp_path, f"127.0.0.1:{port}")
        assert trainer.wait(timeout=180) == 0, trainer_log.read_text()[-3000:]
        ended = time.monotonic()
        text = trainer_log.read_text()
        # Said once per loss: once at the start (the trainer starts before any engine) and
        # once after the kill, with how long the wait may last.
        after_kill = text[text.index("iter 3/") :]
        assert after_kill.count("[trainer] no engine left: waiting up to 60 s for one") == 1, text
        assert f"--coordinator {_coordinator(text)}" in text, text
        (back,) = re.findall(
            r"engine\(s\) \['(.+?)'\] joined and hold version (\d+), after ([\d.]+) s",
            after_kill,
        )
        assert back[0] == second.url and int(back[1]) >= 3, text
        waited = float(back[2])
        print(f"engine killed: the trainer waited {waited:.1f} s with none; run ended "
              f"{ended - killed:.1f} s after the kill")  # fmt: skip
        assert 3 < waited < 60
        assert httpx.get(f"{router.url}/list_workers").json()["urls"] == [second.url]
        version = httpx.get(f"{second.url}/get_weight_version").json()["weight_version"]
        assert version == str(ITERATIONS)
        _check_counts(tmp_path / "run")
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for name in list(workers.procs):
            workers.kill(name)
        for proc in (first, second):
            if proc is not None:
                proc.stop()
        router.stop()


def _coordinator(log: str) -> str:
    """The trainer's Coordinator address, from its start-up line."""
    (address,) = re.findall(r"\[trainer\] coordinator \(gRPC\) at (\S+)", log)
    return address
