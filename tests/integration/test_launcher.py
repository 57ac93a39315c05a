"""The local cluster of `millstream train`: what it starts, that it is healthy, that it stops.

The driver (`tests/support/launcher_driver.py`) stands in for the trainer process: it starts
a whole cluster (private Redis, an engine, the router, a rollout and a reward worker).
Interrupted with SIGINT it stops them all cleanly (a SIGKILLed trainer taking every child
with it, mid-run: tests/e2e/test_train.py). In-process tests cover the watchdog (a dead engine stops the run with the
tail of its log), start-up failures, the Redis-only and nothing-to-start cases, persistence
across restarts, and the one-launcher-per-run-dir lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.common.keys import RunKeys
from millstream.launch.cluster import ClusterUrls, LocalCluster, ServiceExited
from tests.support.launcher_driver import start_all

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["redis", "engine-0", "router", "rollout-0", "reward-0"]


def run_flags(run_dir: Path, model: Path | str, run_id: str = "launch", *extra: str) -> list[str]:
    return [
        "--run-id",
        run_id,
        "--run-dir",
        str(run_dir),
        "--hf-checkpoint",
        str(model),
        "--rollout-batch-size",
        "2",
        *extra,
    ]


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_gone(pids: dict[str, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
        if not alive:
            return
        time.sleep(0.1)
    for pid in alive.values():
        os.kill(pid, signal.SIGKILL)
    pytest.fail(f"orphans still running {timeout_s}s after the trainer went: {alive}")


class Driver:
    """The driver as a subprocess; its stdout is read line by line in a thread."""

    def __init__(self, flags: list[str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.launcher_driver", *flags],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_ready(self, timeout_s: float = 150.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"driver not READY in {timeout_s}s:\n" + "\n".join(self.lines))
            if line is None:
                pytest.fail("driver exited before READY:\n" + "\n".join(self.lines))
            self.lines.append(line)
            if line.startswith("READY "):
                return json.loads(line.removeprefix("READY "))

    def finish(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # hung: its threads' stacks (SIGUSR1), then the lines
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            self.proc.kill()
            self.proc.wait()
            self._reader.join(timeout=5)
            while not self._queue.empty():
                line = self._queue.get()
                if line is not None:
                    self.lines.append(line)
            pytest.fail(f"the driver did not exit in {timeout_s}s:\n" + "\n".join(self.lines))
        self._reader.join(timeout=5)
        while not self._queue.empty():
            line = self._queue.get()
            if line is not None:
                self.lines.append(line)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()


def assert_healthy(ready: dict, run_id: str, run_dir: Path) -> None:
    urls, pids = ready["urls"], ready["pids"]
    assert sorted(pids) == sorted(NAMES)
    for name, pid in pids.items():
        assert pid_alive(pid), f"{name} (pid {pid}) is not running"
        assert (run_dir / "logs" / f"{name}.log").is_file()
    (engine_url,) = urls["engine_urls"]
    assert httpx.get(engine_url + "/health", timeout=5).status_code == 200
    assert httpx.get(urls["router_url"] + "/readiness", timeout=5).status_code == 200
    workers = httpx.get(urls["router_url"] + "/list_workers", timeout=5).json()["urls"]
    assert workers == [engine_url]
    client = redis.Redis.from_url(urls["redis_url"])
    try:
        assert client.ping()
        keys = RunKeys(run_id)
        assert client.exists(keys.config)
        assert client.exists(keys.heartbeat("rollout", "rollout-0"))
        assert client.exists(keys.heartbeat("reward", "reward-0"))
    finally:
        client.close()
    assert (run_dir / "redis" / "appendonlydir").is_dir(), "Redis runs without its AOF"


@pytest.mark.timeout(150)
def test_ctrl_c_stops_every_child_cleanly(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    driver = Driver(run_flags(run_dir, tiny_model_dir))
    try:
        ready = driver.wait_ready()
        driver.proc.send_signal(signal.SIGINT)
        assert driver.finish() in (0, 130), "\n".join(driver.lines)
        wait_gone(ready["pids"], timeout_s=1)
    finally:
        driver.cleanup()
    assert any("stopping 5 local service(s)" in line for line in driver.lines)
    # SIGTERM, not SIGKILL: the workers drained and Redis closed its AOF.
    logs = run_dir / "logs"
    assert "rollout-0]: stopped (processed" in (logs / "rollout-0.log").read_text()
    assert "reward-0: stopped (processed" in (logs / "reward-0.log").read_text()
    assert "ready to exit" in (logs / "redis.log").read_text()


@pytest.mark.timeout(150)
def test_a_dead_engine_stops_the_run_with_its_log_tail(tmp_path, tiny_model_dir, redis_url):
    """Given --redis-url, only the engine, the router and the workers (Celery's too, with
    --reward-executor celery) start; the watchdog reports a SIGKILLed engine with the last
    lines of its log."""
    flags = run_flags(tmp_path / "run", tiny_model_dir, "watch", "--redis-url", redis_url)
    cfg = parse_run_config([*flags, "--reward-executor", "celery"])
    cluster = LocalCluster(cfg, say=lambda _msg: None)

    async def scenario() -> None:
        urls = await start_all(cluster)
        assert urls.redis_url == redis_url
        names = ["engine-0", "reward-0", "reward-celery-0", "rollout-0", "router"]
        assert sorted(cluster.pids) == names
        cluster.check()
        os.kill(cluster.pids["engine-0"], signal.SIGKILL)
        await asyncio.wait_for(cluster.watch(interval_s=0.1), timeout=10)

    pids: dict[str, int] = {}
    try:
        with pytest.raises(ServiceExited) as caught:
            asyncio.run(scenario())
        pids = cluster.pids
    finally:
        cluster.stop()
    err = caught.value
    assert err.name == "engine-0" and err.returncode == -signal.SIGKILL
    log = tmp_path / "run" / "logs" / "engine-0.log"
    last_line = log.read_text().rstrip("\n").splitlines()[-1]
    assert "engine-0 exited with code -9 (SIGKILL)" in str(err)
    assert str(log) in str(err) and last_line in str(err)
    wait_gone(pids, timeout_s=1)
    cluster.stop()  # idempotent
    cluster.check()  # a stopped cluster reports nothing


@pytest.mark.timeout(60)
def test_an_engine_that_fails_to_start_stops_the_start_with_its_log(tmp_path, redis_url):
    empty_model = tmp_path / "not-a-model"
    empty_model.mkdir()
    cfg = parse_run_config(
        run_flags(tmp_path / "run", empty_model, "bad", "--redis-url", redis_url)
    )
    cluster = LocalCluster(cfg, say=lambda _msg: None)
    with pytest.raises(ServiceExited, match=r"engine-0 exited with code 1 while starting") as e:
        asyncio.run(cluster.start_infra())
    assert "not-a-model" in e.value.tail
    assert all(child.poll() is not None for child in cluster.children)


@pytest.mark.timeout(60)
def test_private_redis_persists_its_streams_and_keeps_its_password_private(tmp_path):
    """Only --router-url given: just Redis starts. Its data survives a restart of the run,
    its password is in a 0600 config file, not on the command line, and one launcher at a
    time owns a run dir."""
    run_dir = tmp_path / "run"
    flags = run_flags(run_dir, tmp_path, "persist", "--router-url", "http://127.0.0.1:9")
    flags += ["--redis-password", "s3cret"]
    cfg = parse_run_config(flags)

    first = LocalCluster(cfg, say=lambda _msg: None)
    try:
        urls = asyncio.run(first.start_infra())
        assert urls == ClusterUrls(urls.redis_url, "http://127.0.0.1:9", ())
        assert list(first.pids) == ["redis"]
        cmdline = Path(f"/proc/{first.pids['redis']}/cmdline").read_bytes()
        assert b"s3cret" not in cmdline
        conf = run_dir / "redis" / "redis.conf"
        assert conf.stat().st_mode & 0o777 == 0o600
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(urls.redis_url).ping()
        client = redis.Redis.from_url(urls.redis_url, password="s3cret")
        client.xadd("persist:prompts", {"data": b"x"})
        client.close()
        with pytest.raises(MillstreamError, match="another launcher"):
            asyncio.run(LocalCluster(cfg, say=lambda _msg: None).start_infra())
    finally:
        first.stop()

    second = LocalCluster(cfg, say=lambda _msg: None)
    try:
        urls = asyncio.run(second.start_infra())
        client = redis.Redis.from_url(urls.redis_url, password="s3cret")
        assert client.xlen("persist:prompts") == 1
        client.close()
    finally:
        second.stop()


def test_with_both_urls_nothing_is_started(tmp_path):
    run_dir = tmp_path / "run"
    flags = run_flags(run_dir, tmp_path, "given", "--redis-url", "redis://127.0.0.1:9/0")
    cfg = parse_run_config([*flags, "--router-url", "http://127.0.0.1:9/"])
    cluster = LocalCluster(cfg, say=lambda _msg: None)

    async def scenario() -> ClusterUrls:
        urls = await cluster.start_infra()
        await cluster.start_workers()
        return urls

    urls = asyncio.run(scenario())
    assert urls == ClusterUrls("redis://127.0.0.1:9/0", "http://127.0.0.1:9", ())
    assert urls.apply(cfg).service.router_url == "http://127.0.0.1:9"
    assert cluster.children == [] and not run_dir.exists()
    cluster.stop()


SPAWN_BESIDE_GRPC = """
import os, sys, threading
from concurrent import futures
from pathlib import Path

import millstream.cli  # noqa: F401  (what every millstream process imports first)
import grpc

from millstream.launch import procs

print(os.environ.get("GRPC_ENABLE_FORK_SUPPORT"))
server = grpc.server(futures.ThreadPoolExecutor(2))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}")
stop = threading.Event()

def busy():  # gRPC threads at work while we fork, as the trainer's Coordinator can be
    while not stop.is_set():
        try:
            grpc.channel_ready_future(channel).result(timeout=0.01)
        except grpc.FutureTimeoutError:
            pass

threading.Thread(target=busy, daemon=True).start()
codes = [
    procs.spawn(f"c{i}", ["/bin/true"], Path(sys.argv[1]) / f"c{i}.log", tier=0).proc.wait()
    for i in range(40)
]
stop.set()
print(sum(code != 0 for code in codes))
"""


def test_children_started_beside_busy_grpc_threads_all_live(tmp_path):
    """A process whose gRPC threads are busy (the trainer serving the Coordinator) starts
    children with fork, `procs`' set-up, then exec: with gRPC's fork handlers on (its default)
    ~1 in 15 of them died before exec. `millstream.cli` turns them off for every service."""
    out = subprocess.run(
        [sys.executable, "-c", SPAWN_BESIDE_GRPC, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    setting, failed = out.stdout.split()
    assert setting == "false" and failed == "0", out.stderr[-2000:]
