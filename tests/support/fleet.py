"""The simulated fleet (bench/fleet_engine.py) as a real process: N engines on one event loop,
one port each, for the fleet bench and the tests that need engines faster than a model.

    fleet = FleetProcess(tmp_path, engines=2, args=["--decode-step-ms", "1"])
    fleet.urls                      # ["http://127.0.0.1:PORT", ...]
    fleet.stats(fleet.urls[0])      # that engine's counters (GET /fleet_stats)
    fleet.stop()
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "fleet_engine.py"


class FleetProcess:
    def __init__(
        self, workdir: Path, engines: int, args: Sequence[str] = (), timeout_s: float = 30.0
    ):
        self.urls_file = Path(workdir) / f"fleet-{os.getpid()}-{time.monotonic_ns()}.json"
        self.log_path = self.urls_file.with_suffix(".log")
        argv = [sys.executable, str(SCRIPT), "--engines", str(engines)]
        argv += ["--urls-file", str(self.urls_file), *args]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.urls_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the simulated fleet did not start:\n{self.log_tail()}")
            time.sleep(0.05)
        found = json.loads(self.urls_file.read_text())
        self.urls: list[str] = found["urls"]
        self.model: str = found["model"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stats(self, url: str) -> dict:
        return httpx.get(f"{url}/fleet_stats", timeout=10).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
