"""A process and its descendants, read from /proc: who they are and the CPU they use.

`CpuSampler` records the cumulative CPU seconds of every process of a tree, by role (the
millstream command: train, engine, router, rollout, reward; redis-server), every `every_s`
seconds in a thread, so that a bench can say where the cores went between two instants. A
process that exits keeps the CPU of its last sample (at most `every_s` of it is missed). Each
sample also holds the busy and stolen CPU seconds of the CPUs the tree may run on (the whole
machine by default), so that a bench can tell its own processes' work from anything else
those CPUs did meanwhile.

`machine()` says what the machine is (CPU model, cores, memory) and `cpu_list` writes a CPU
set the way taskset does, for the line a bench prints next to its tables.
"""

from __future__ import annotations

import bisect
import os
import platform
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
MACHINE, STEAL = "(machine)", "(steal)"  # pseudo-roles in a sample: see machine_seconds


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command's name (which may hold spaces): field 3 is index 0."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """Every descendant of `pid`, from /proc."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields is not None:
                parent_of[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        found += kids
        frontier += kids
    return found


def name_of(pid: int) -> str:
    """The millstream command (train-async, engine, router...) or a worker's consumer name;
    the executable's name for anything else."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    script = [i for i, a in enumerate(argv) if a == "millstream.cli" or a.endswith("/millstream")]
    if script:
        if "--consumer-name" in argv:
            return argv[argv.index("--consumer-name") + 1]
        return argv[script[0] + 1]
    return Path(argv[0]).name


def role_of(pid: int) -> str:
    """name_of without a worker's index: trainer, engine, router, rollout, reward, redis."""
    name = name_of(pid)
    for role in ("rollout", "reward", "engine", "redis"):
        if name.startswith(role):
            return role
    return "trainer" if name.startswith("train") else name


def machine_seconds(cpus: Iterable[int] | None = None) -> dict[str, float]:
    """CPU seconds so far (/proc/stat) of `cpus` (None: every core): busy (any process) and
    stolen by the hypervisor."""
    lines = Path("/proc/stat").read_text().splitlines()
    if cpus is None:
        rows = lines[:1]
    else:
        wanted = {f"cpu{c}" for c in cpus}
        rows = [line for line in lines if line.split(maxsplit=1)[0] in wanted]
    busy = steal = 0
    for row in rows:
        user, nice, system, _idle, _iowait, irq, softirq, stolen = map(int, row.split()[1:9])
        busy, steal = busy + user + nice + system + irq + softirq, steal + stolen
    return {MACHINE: busy * TICK_S, STEAL: steal * TICK_S}


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU of the process (all its threads) so far."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) * TICK_S


class RoleSampler:
    """Cumulative CPU seconds per role of the pids it is given (`add`), sampled every
    `every_s` in a thread, with the busy and stolen seconds of `cpus` (None: all); `at` and
    `between` interpolate two samples. A pid that exits keeps its last reading."""

    def __init__(self, every_s: float = 0.1, cpus: Iterable[int] | None = None):
        self.every_s = every_s
        self.cpus = None if cpus is None else sorted(cpus)
        self.times: list[float] = []  # time.time() of each sample
        self.samples: list[dict[str, float]] = []  # role -> CPU seconds so far, per sample
        self._pids: dict[int, str] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def add(self, pid: int, role: str) -> None:
        self._pids[pid] = role

    def start(self) -> RoleSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()

    def _discover(self, since_start_s: float, n: int) -> None:
        """Before each sample: find pids of its own (a subclass's)."""

    def _run(self) -> None:
        start, n = time.monotonic(), 0
        while not self._stop.is_set():
            self._discover(time.monotonic() - start, n)
            self.sample()
            n += 1
            self._stop.wait(self.every_s)
        self.sample()

    def sample(self) -> None:
        """One reading now (the thread calls it every `every_s`; a caller without the thread
        may call it by hand)."""
        for pid in list(self._pids):
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self._last[pid] = cpu
        by_role: dict[str, float] = {}
        for pid, cpu in self._last.items():
            by_role[self._pids[pid]] = by_role.get(self._pids[pid], 0.0) + cpu
        self.times.append(time.time())
        self.samples.append(by_role | machine_seconds(self.cpus))

    def at(self, t: float) -> dict[str, float]:
        """CPU seconds per role at wall time `t` (time.time()), linear between two samples."""
        if not self.times:
            return {}
        i = bisect.bisect_right(self.times, t)
        if i == 0:
            return dict(self.samples[0])
        if i == len(self.times):
            return dict(self.samples[-1])
        t0, t1 = self.times[i - 1], self.times[i]
        a, b, w = self.samples[i - 1], self.samples[i], (t - t0) / (t1 - t0)
        return {r: a.get(r, 0.0) + w * (b.get(r, 0.0) - a.get(r, 0.0)) for r in b.keys() | a}

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per role used between wall times t0 and t1."""
        a, b = self.at(t0), self.at(t1)
        return {r: b.get(r, 0.0) - a.get(r, 0.0) for r in b}


class CpuSampler(RoleSampler):
    """A RoleSampler over `pid`'s process tree, each process's role by its name.

    The tree is rescanned every sample for the first `discover_s` seconds (services start),
    then every `rescan_every` samples, which keeps the sampler's own cost near 1 ms a sample.
    """

    def __init__(
        self,
        pid: int,
        every_s: float = 0.1,
        discover_s: float = 5.0,
        cpus: Iterable[int] | None = None,
    ):
        super().__init__(every_s, cpus)
        self.pid, self.discover_s = pid, discover_s
        self.rescan_every = 10
        self.add(pid, role_of(pid))

    def _discover(self, since_start_s: float, n: int) -> None:
        discovering = since_start_s < self.discover_s
        if discovering or n % self.rescan_every == 0:
            for pid in [self.pid, *children(self.pid)]:
                if discovering or pid not in self._pids:  # a fork may not have exec'd yet
                    role = role_of(pid)
                    if role not in ("?", ""):  # gone, or a zombie
                        self._pids[pid] = role


# -- the machine -----------------------------------------------------------------------------


def machine() -> dict[str, object]:
    """The CPU model (/proc/cpuinfo), the cores the host has and this process may use, and
    the memory (/proc/meminfo)."""
    models = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    return {
        "cpu_model": models[0] if models else platform.machine(),
        "cores_total": os.cpu_count() or 1,
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(kib / 2**20, 1),
    }


def git_commit() -> str:
    """`git rev-parse --short HEAD`, with +dirty when the tree has changes; where there is no
    git or no .git (a copied tree on a GPU machine), $MILLSTREAM_COMMIT, else "unknown"."""

    def git(*argv: str) -> str | None:
        try:
            proc = subprocess.run(["git", *argv], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                                  check=False, timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return os.environ.get("MILLSTREAM_COMMIT") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain") else "")


def cpu_list(cpus: Iterable[int]) -> str:
    """CPUs as taskset writes them: 0-3,8,10-11."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
