"""A real redis-server on a free loopback port in a temp dir, stopped afterwards."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port nobody listens on, never one this process handed out before: two
    threads starting services at once (the kernel may give a just-closed port again) got
    the same port, and one service failed to bind."""
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


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
