"""A real `millstream engine` process on a free loopback port, for integration tests.

Starts `python -m millstream.cli engine --model-path DIR --port P [extra flags]`, waits for
/health, and stops it with SIGTERM (then SIGKILL). Its output goes to a log file whose tail
is put in every failure message, so a test that fails says why the engine did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.redis_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


class EngineProcess:
    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        *extra_args: str,
        startup_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        simulated_cuda: bool = False,
    ):
        self.simulated_cuda = simulated_cuda
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_dir) / f"engine-{self.port}.log"
        # simulated_cuda: on a GPU simulated on the CPU (tests/support/sim_cuda/), with the
        # `--device cuda` that makes the engine use it.
        args = [
            sys.executable,
            "-m",
            "tests.support.sim_cuda" if simulated_cuda else "millstream.cli",
            "engine",
            "--model-path",
            str(model_dir),
            "--port",
            str(self.port),
            # One compute thread: tests run engines beside pytest and each other on 2 cores
            # (the CPU budget, common/threads.py); a later --num-threads in extra_args wins.
            "--num-threads",
            "1",
            *(("--device", "cuda") if simulated_cuda else ()),
            *extra_args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env
        )
        try:
            self._wait_healthy(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return "(no engine log)"

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self.proc.returncode} during startup:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"engine not healthy within {timeout_s}s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


def start_engines(
    model_dir: Path, log_dir: Path, count: int, *extra_args: str
) -> list[EngineProcess]:
    """`count` engines started at once (each waits for its own /health), ready; if one fails,
    those that started are stopped before the error propagates, not left running (and their
    open logs) to fail a later test's garbage collection."""
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(EngineProcess, model_dir, log_dir, *extra_args) for _ in range(count)
        ]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                if f.exception() is None:
                    f.result().stop()
            raise


def engine_fixtures(
    *extra_args: str, model: str = "tiny_model_dir", devices: tuple[str, ...] = ("cpu",)
) -> tuple[Any, Any]:
    """A test module's own engine and an HTTP client to it, both module-scoped: the engine on
    the model that fixture `model` names, with `extra_args`. Use as
    `engine, client = engine_fixtures("--seed", "3")` at the module's top level. With
    `devices=("cpu", "sim-cuda")` the module runs once per device, the second on a GPU
    simulated on the CPU (in float32, which the tests' 1e-4 tolerances assume; CUDA graphs up
    to 4 rows)."""

    @pytest.fixture(scope="module", params=devices)
    def engine(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[EngineProcess]:
        model_dir = request.getfixturevalue(model)
        sim = request.param == "sim-cuda"
        proc = EngineProcess(
            model_dir,
            tmp_path_factory.mktemp("engine"),
            # Graphs for 1, 2 and 4 rows: each capture is slow when simulated, and more rows
            # decode eagerly, on the device too.
            *(("--dtype", "float32", "--cuda-graph-max-bs", "4") if sim else ()),
            *extra_args,
            simulated_cuda=sim,
        )
        yield proc
        proc.stop()

    @pytest.fixture(scope="module")
    def client(engine: EngineProcess) -> Iterator[httpx.Client]:
        with httpx.Client(base_url=engine.url, timeout=60.0) as c:
            yield c

    return engine, client
