"""A real redis-server on a free loopback port in a temp dir, stopped afterwards."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

_LOCK = threading.Lock()
_SPAN_SIZE = 12_000  # ports below the kernel's ephemeral range, shared by the xdist workers


def _port_span() -> range:
    """This process' ports: its xdist worker's share of the ports just below the kernel's
    ephemeral range (ip_local_port_range: 32768-60999 here). bind(("127.0.0.1", 0)) hands
    out ephemeral ports, so a port taken that way and closed could be handed out again to the
    other worker, or to a service a test started, before its own service bound it (the other
    worker's engine took an engine's port between the two, a clean clone's make test at
    57a8faf). Below the range, and split by worker, no one else is handed the port."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    bottom = max(1024, ephemeral - _SPAN_SIZE)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    size = (ephemeral - bottom) // max(workers, 1)
    return range(bottom + index * size, bottom + (index + 1) * size)


_SPAN = _port_span()
_NEXT = random.Random(os.getpid()).randrange(len(_SPAN))  # another pytest beside this one


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port nobody listens on, from this process' span (`_port_span`), in turn:
    none is handed out again before the span's other ~6,000 were (two threads starting
    services at once got the same port from the kernel, and one service failed to bind)."""
    global _NEXT
    with _LOCK:
        for _ in range(len(_SPAN)):
            port = _SPAN[_NEXT % len(_SPAN)]
            _NEXT += 1
            if _bindable(port):
                return port
    raise RuntimeError(f"no free loopback port in {_SPAN.start}-{_SPAN.stop - 1}")


class RedisServer:
    """`appendonly`: AOF on (fsync every second), so `restart()` finds its streams again;
    `maxmemory`: bytes Redis may hold (0: no bound), under maxmemory-policy noeviction."""

    def __init__(
        self,
        workdir: Path,
        password: str | None = None,
        *,
        appendonly: bool = False,
        maxmemory: int = 0,
    ):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not on PATH: run `make test` (it installs Debian's redis-server)"
            )
        self.port = free_port()
        self.password = password
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if appendonly else "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            # As every Redis millstream starts: never evict (a lost stream entry is a lost
            # group); at `maxmemory` (0: none) writes that add data wait for room.
            "--maxmemory-policy",
            "noeviction",
            "--maxmemory",
            str(maxmemory),
        ]
        if password:
            args += ["--requirepass", password]
        self.args = args
        self.log = open(workdir / "redis.log", "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def restart(self, down_s: float = 0.5) -> None:
        """SIGTERM (Redis writes its AOF out and exits), `down_s` of absence, the same port."""
        self.proc.terminate()
        self.proc.wait(timeout=10)
        time.sleep(down_s)
        self.start()

    def start(self) -> None:
        """Start it again (after the process ended), on the same port and directory."""
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
