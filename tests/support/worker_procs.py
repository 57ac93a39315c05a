"""Real worker processes of one run (`python -m millstream.cli <command> --redis-url ... --run-id
...`), each logging to `{log_dir}/{name}.log`, for the integration and e2e tests.

Started from the repo root with it on PYTHONPATH, so test plugins (`tests.support.*`) import.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from millstream.common.keys import RunKeys

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcs:
    def __init__(self, redis_url: str, run_id: str, log_dir: Path):
        self.redis_url = redis_url
        self.run_id = run_id
        self.log_dir = Path(log_dir)
        self.procs: dict[str, subprocess.Popen] = {}

    def spawn(self, command: str, name: str, extra: Sequence[str]) -> subprocess.Popen:
        argv = [sys.executable, "-m", "millstream.cli", command]
        argv += ["--redis-url", self.redis_url, "--run-id", self.run_id, *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        with (self.log_dir / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def _check_alive(self, name: str, deadline: float, waiting_for: str) -> None:
        if self.procs[name].poll() is not None:
            raise AssertionError(f"{name} exited early:\n{self.log(name)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never {waiting_for}:\n{self.log(name)}")
        time.sleep(0.05)

    def wait_for_log(self, name: str, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log(name):
            self._check_alive(name, deadline, f"logged {text!r}")

    def wait_beating(self, kind: str, name: str, timeout_s: float = 30.0) -> None:
        """Until the worker's heartbeat key exists (it read the config and is consuming)."""
        key = RunKeys(self.run_id).heartbeat(kind, name)
        client = redis.Redis.from_url(self.redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            while not client.exists(key):
                self._check_alive(name, deadline, "beat")
        finally:
            client.close()

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name} ignored signal {sig}:\n{self.log(name)}") from None

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
