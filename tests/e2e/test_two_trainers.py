"""Two trainers for one run id (an orchestrator's restart behind a partition, an operator who
deploys twice), as from two hosts: each with its own run dir and Coordinator port, the same
Redis, router and engine (tests/chaos/harness.py's deployment on loopback).

The first trains on. A second told `--lease-held exit` exits 5 naming the holder; one told to
wait says so and waits, and takes the run only once the first has ended. A holder that finds a
newer trainer took its run (here: the run's lease and fencing number moved on in Redis, as a
newer trainer's acquire does after the old lease expired) stops with exit 5 and trains no more.
The fenced refusals themselves (the engine's, the router's, the buffer's acks and claims) are
tests/integration/test_admin_auth.py and test_lease.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.chaos.harness import Deployment, write_prompts
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _second(d: Deployment, workdir: Path, *flags: str) -> tuple[subprocess.Popen, Path]:
    """A trainer of the same run, as from another host: own run dir, Coordinator port, log."""
    log = workdir / "second.log"
    argv = d.trainer_argv(4, "--run-dir", str(workdir / "second"), "--coordinator-port",
                          str(free_port()), "--log-level", "info", *flags)  # fmt: skip
    with log.open("a") as out:
        proc = subprocess.Popen(argv, cwd=d.workdir, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _wait_for(path: Path, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (path.read_text(errors="replace") if path.exists() else ""):
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.2)


def test_one_trainer_per_run_the_second_exits_or_waits_and_an_old_holder_stops(
    tiny_model_dir: Path, tmp_path: Path
):
    d = Deployment(tmp_path, tiny_model_dir, write_prompts(tmp_path / "prompts.jsonl"))
    try:
        first = d.start_trainer(400, "--lease-ttl", "3")  # ~0.1 s an iteration
        d.wait_iterations(2, first)

        refused, log = _second(d, tmp_path, "--lease-held", "exit")
        assert refused.wait(timeout=60) == 5, log.read_text()[-2000:]
        said = log.read_text()
        host = socket.gethostname()
        assert f"run chaos is held by the trainer on {host} (pid {first.pid}" in said, said
        assert "--lease-held wait" in said

        waiting, log = _second(d, tmp_path)
        _wait_for(log, "waiting for it (--lease-held wait")
        before = d.iterations()
        d.wait_iterations(before + 3, first)  # the first trains on meanwhile
        assert waiting.poll() is None and "iter 1/" not in log.read_text()

        # A newer trainer took the run (what its acquire writes after the old lease expired).
        r = redis.Redis.from_url(d.redis.url)
        fence = int(r.get("chaos:fence")) + 1
        r.set("chaos:fence", fence)
        r.delete("chaos:lease")
        r.hset("chaos:lease", mapping={"fence": fence, "holder": json.dumps({"host": "node-b"})})
        r.pexpire("chaos:lease", 60_000)
        assert first.wait(timeout=30) == 5, d.trainer_log.read_text()[-3000:]
        trained = d.iterations()
        text = d.trainer_log.read_text()
        # Whichever noticed first (the buffer's fenced ack, the renewal) says the same.
        assert "lost the lease" in text and "without training on" in text, text[-3000:]
        # Its end beside the run's summary, which is the holder's to write (a shared run dir).
        assert not (d.run_dir / "summary.json").exists()
        lost = json.loads((d.run_dir / f"summary.lost-lease-{first.pid}.json").read_text())
        assert lost["exit_code"] == 5 and "lost the lease" in lost["ended"], lost
        assert trained < 400 and d.iterations() == trained  # it trained no more

        # The run is "node-b"'s now: the waiting trainer goes on waiting, naming it.
        _wait_for(log, "held by the trainer on node-b", timeout_s=20)
        assert waiting.poll() is None
        r.delete("chaos:lease")  # node-b's lease expires: the waiting one takes the run
        _wait_for(log, "the lease is ours", timeout_s=30)
        waiting.terminate()
        waiting.wait(timeout=60)
        r.close()
    finally:
        d.stop()
