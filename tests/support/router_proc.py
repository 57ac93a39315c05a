"""Real `millstream <command>` processes on loopback: start, wait until they answer, stop, kill.

    router = start_router(tmp_path, "--worker-urls", engine.url)
    router.url                      # http://127.0.0.1:PORT
    router.kill()                   # SIGKILL, as a crash would
    router.stop()                   # SIGTERM, then SIGKILL after a grace period

`start_service` is generic (the router's tests also use it to start engines); every process
logs to a file in the test's temp dir, and a process that dies or never answers raises with
the tail of that log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


class ServiceProcess:
    def __init__(
        self,
        command: str,
        args: list[str],
        workdir: Path,
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ):
        self.port = port or free_port()
        self.name = f"{command}-{self.port}"
        self.log_path = workdir / f"{self.name}.log"
        argv = [sys.executable, "-m", "millstream.cli", command, "--port", str(self.port), *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, path: str, timeout_s: float = 120.0) -> ServiceProcess:
        """Poll GET `path` until it answers 200; raise with the log if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(
            f"{self.name} did not answer {path} within {timeout_s}s:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


def start_service(
    command: str,
    args: list[str],
    workdir: Path,
    *,
    ready_path: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 120.0,
) -> ServiceProcess:
    return ServiceProcess(command, args, workdir, env=env).wait_ready(ready_path, timeout_s)


def start_router(workdir: Path, *args: str, env: dict[str, str] | None = None) -> ServiceProcess:
    """A router on a free port, ready once /liveness answers (its workers had one check)."""
    return start_service(
        "router", list(args), workdir, ready_path="/liveness", env=env, timeout_s=30
    )
