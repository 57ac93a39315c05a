"""A trainer given --redis-url may start before that Redis does (`docker stack deploy` starts
every service at once and orders nothing): it waits for Redis, for up to
--redis-outage-timeout, and then runs to its end. The same trainer, with Redis never coming,
fails naming the URL: tests/integration/test_config_redis.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TERMINAL = ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end")


def test_a_trainer_started_before_redis_waits_for_it_then_trains(
    tiny_model_dir: Path, tmp_path: Path
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(20))
    )
    server = RedisServer(tmp_path)  # for its port and arguments: down until the trainer waits
    server.proc.terminate()
    server.proc.wait(timeout=10)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable, "-m", "millstream.cli", "train", "--redis-url", server.url,
        "--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--num-rollout", "2",
        "--run-dir", str(run_dir), "--run-id", "late-redis", "--log-level", "warning",
    ]  # fmt: skip
    trainer = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: list[str] = []
    waiting = threading.Event()

    def read() -> None:
        for line in trainer.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "unreachable for" in line and server.url in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # connect() says so after 5 s of waiting; a trainer that does not wait exits first.
        deadline = time.monotonic() + 90
        while not waiting.wait(timeout=0.2):
            assert trainer.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
        server.start()
        code = trainer.wait(timeout=180)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        reader.join(timeout=10)
        trainer.stdout.close()  # type: ignore[union-attr]
        server.stop()
    out = "".join(lines)
    assert code == 0, out[-4000:]
    assert "cannot reach Redis" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    counts = summary["counts"]
    assert summary["ended"] == "finished", summary
    assert counts["trained"] >= 2 and counts["admitted"] == sum(counts[k] for k in TERMINAL)
