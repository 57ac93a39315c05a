"""Child processes that cannot outlive the trainer: spawn, log to a file, tail, stop.

Every child gets, between fork and exec:

* `PR_SET_PDEATHSIG`: the kernel signals the child when the thread that spawned it dies, so a
  trainer killed with SIGKILL (no `finally`, no handler) still takes its children with it.
  The signal goes when the spawning *thread* exits, not the process: spawn from the thread
  that lives as long as the run (the main thread; `spawn` refuses any other).
* its own process group (not a new session): Ctrl-C in a terminal then reaches only the
  trainer, which stops the children in order (workers before the router, engines and Redis
  they drain into) instead of every process racing to exit at once.

One launcher per run dir (`RunDirLock`): two would share the Redis data dir and the logs.

A child's stdout and stderr go to `{run_dir}/logs/{name}.log`, appended to with a header, so
a restarted run keeps the previous run's log; `tail()` reads only this child's part of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1

_prctl = None


def _libc_prctl():
    """prctl(2) from libc, looked up in the parent: the child between fork and exec should
    only call it, not load libraries."""
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def _in_child(parent_pid: int, death_signal: int, prctl) -> None:
    # Runs in the child between fork and exec: no allocation-heavy work, no imports.
    os.setpgid(0, 0)
    if prctl(PR_SET_PDEATHSIG, death_signal) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        # The parent died before prctl took effect: the death signal will never come.
        os.kill(os.getpid(), death_signal)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """`code 1`, or `code -9 (SIGKILL)` for a child killed by a signal."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} ({signal.Signals(-code).name})"
    return f"code {code}"


@dataclass
class Child:
    """One started service process; `tier` orders shutdown (highest stops first)."""

    name: str
    argv: list[str]
    log_path: Path
    tier: int
    proc: subprocess.Popen
    log_offset: int
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 20) -> str:
        """The last `lines` lines this child wrote to its log."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError as err:
            return f"(cannot read {self.log_path}: {err})"
        kept = text.rstrip("\n").splitlines()[-lines:]
        return "\n".join(kept) if kept else "(the log is empty)"


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    tier: int,
    env: Mapping[str, str] | None = None,
    death_signal: int = signal.SIGTERM,
) -> Child:
    """Start `argv` with its output appended to `log_path`; it dies with this thread."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"spawn {name!r} from the main thread: the kernel sends a child its death signal "
            "when the thread that started it exits, so a child started from a worker thread "
            "would be killed when that thread ends"
        )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(
            f"\n--- {name} started {time.strftime('%Y-%m-%d %H:%M:%S')} by the millstream "
            f"launcher: {' '.join(argv)}\n".encode()
        )
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=False,
            preexec_fn=functools.partial(_in_child, os.getpid(), death_signal, _libc_prctl()),
        )
    return Child(name, list(argv), log_path, tier, proc, offset)


def stop_children(children: Sequence[Child], timeout_s: float) -> None:
    """SIGTERM the children (in the order given), wait up to `timeout_s`, SIGKILL the rest."""
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    kill_children(children)


def kill_children(children: Sequence[Child]) -> None:
    """SIGKILL whatever is still running and reap it."""
    for child in children:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
    for child in children:
        # With a timeout, Popen.wait never blocks on its internal lock: this may run from a
        # signal handler that interrupted another wait on the same child.
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=5.0)


class RunDirLock:
    """An exclusive flock on `{run_dir}/launcher.lock`, holding the owner's pid."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "launcher.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; BlockingIOError naming the holder's pid if another process has it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise BlockingIOError(f"held by pid {holder}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
