"""One stage of `make gpu-check` (bench/gpu_check.py): a command under a time limit, its output
in a log, the device's peak memory beside it, and nothing it started left running after it.

A stage's command starts in a session of its own, so a SIGINT to its process group reaches
what it runs in the foreground (pytest writes what it has, bench_gpu.py stops its engines).
But bench_gpu.py's arith run starts run.sh in another session (setsid), and the trainer's
services may start more: a killpg of the stage misses them, and an engine left holding its
memory makes the next stage, or the next run, start out of memory. So every stage's process
gets MARK=<a token of its own> in its environment, which every descendant inherits through
fork, exec and setsid alike; after the stage, in time or not, every process whose
/proc/PID/environ holds the token is killed (SIGKILL) and waited for until none is left. A
process that empties its environment would escape; nothing millstream starts does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MARK = "MILLSTREAM_GPU_CHECK_STAGE"
GRACE_S = 10.0  # after the SIGINT, before the SIGKILL: pytest's summary, an engine's stop


def say(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class MemorySampler:
    """The peak of the device's memory in use (MiB) while a stage runs: nvidia-smi's
    memory.used of the first visible GPU, or on the CPU the host's MemTotal - MemAvailable."""

    def __init__(self, device: str, period_s: float = 0.2):
        self.device, self.period_s = device, period_s
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._smi = shutil.which("nvidia-smi") if device == "cuda" else None

    def read_mib(self) -> float | None:
        if self.device == "cuda":
            if self._smi is None:
                return None
            index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            try:
                out = subprocess.run(
                    [self._smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                     "-i", index], capture_output=True, text=True, timeout=5, check=True,
                ).stdout  # fmt: skip
                return float(out.split()[0])
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return None
        info = dict(
            (line.split(":")[0], float(line.split()[1]))
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith(("MemTotal:", "MemAvailable:"))
        )
        return (info["MemTotal"] - info["MemAvailable"]) / 1024

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            mib = self.read_mib()
            if mib is not None:
                self.peak = mib if self.peak is None else max(self.peak, mib)
            self._stop.wait(self.period_s)


def marked(token: str) -> list[int]:
    """Every live process but this one whose environment holds MARK=token (a zombie's
    environ reads empty: it holds no memory and is not counted)."""
    needle = f"{MARK}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def end_marked(token: str, wait_s: float = 30.0) -> int:
    """SIGKILL every process marked with `token` until none is left (a process that dies in
    the driver may take a moment); how many there were."""
    ended: set[int] = set()
    deadline = time.monotonic() + wait_s
    while pids := marked(token):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        ended |= set(pids)
        if time.monotonic() > deadline:
            say(f"processes {sorted(pids)} still alive {wait_s:.0f} s after SIGKILL")
            break
        time.sleep(0.1)
    return len(ended)


def run_stage(
    name: str, argv: list[str], limit_s: float, work: Path, device: str,
    env: dict[str, str] | None = None, grace_s: float = GRACE_S,
) -> dict:  # fmt: skip
    """`argv` under `limit_s` (SIGINT to its group, SIGKILL `grace_s` later), its output in
    work/NAME.log; then every process it started ended (module docstring)."""
    log = work / f"{name}.log"
    token = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    say(f"=== {name} (limit {limit_s:.0f} s): {' '.join(argv[1:4])} ...")
    start = time.monotonic()
    with log.open("w") as sink, MemorySampler(device) as memory:
        env = {**(os.environ if env is None else env), MARK: token}
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)  # fmt: skip
        timed_out = False
        try:
            rc = proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGINT)
            try:
                rc = proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        left = end_marked(token)
    seconds = time.monotonic() - start
    say(f"{name}: exit {rc} in {seconds:.0f} s{' (out of time)' if timed_out else ''}"
        f"{f'; {left} processes it left ended' if left else ''}")  # fmt: skip
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {"rc": rc, "seconds": round(seconds, 1), "timed_out": timed_out,
            "peak_mib": memory.peak, "tail": tail, "left_running": left}  # fmt: skip


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
