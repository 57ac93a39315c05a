"""A run deployed service by service on loopback, as `docker compose up` deploys it, so that any
one process can be killed and started again while the trainer trains.

    d = Deployment(workdir, model, prompts, engines=2)
    trainer = d.start_trainer(num_rollout=200)
    d.workers.kill("rollout-0"); d.spawn_worker("rollout", "rollout-0")
    d.redis.restart()
    result = d.finish(trainer)              # exit code, summary counts, trained-twice

Redis has its append-only file on; the router gates on weight versions; engines join through
the trainer's Coordinator (so a restarted engine is synced before it is routed); the trainer
gets --redis-url and --router-url, so it starts nothing and a kill of it kills only it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.redis_server import RedisServer, free_port
from tests.support.router_proc import ROOT, ServiceProcess, start_router
from tests.support.worker_procs import WorkerProcs

HEALTH_INTERVAL_S = 1.0
CLAIM_IDLE_MS = 2000  # a killed worker's entries are taken over after this


@dataclass
class RunResult:
    """What one trainer process left: its exit code, summary counts and trained group ids."""

    returncode: int
    counts: dict[str, int]
    trained_twice: int
    log: str

    @property
    def lost(self) -> int:
        c = self.counts
        unaccounted = c.get("admitted", 0) - sum(
            c.get(k, 0)
            for k in ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end")
        )
        return max(unaccounted, c.get("in_flight_lost", 0))


@dataclass
class Row:
    """One line of the chaos table."""

    fault: str
    injected: int
    outcome: str
    result: RunResult | None = None
    problems: list[str] = field(default_factory=list)
    longest_stall_s: float | None = None  # the longest time without a new iteration
    stall_bound_s: float | None = None  # a broken promise past this (restarts.bounded)

    @property
    def ok(self) -> bool:
        return not self.problems


def write_prompts(path: Path, n: int = 40, bad_labels: tuple[str, ...] = ()) -> Path:
    """`n` additions (`i+i=` -> `2i`), then one row per bad label (the reward plugin's cues)."""
    rows = [{"prompt": f"{i}+{i}=", "label": str(2 * i)} for i in range(n)]
    rows += [{"prompt": f"{i}+1=", "label": label} for i, label in enumerate(bad_labels)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Deployment:
    def __init__(
        self,
        workdir: Path,
        model: Path,
        prompts: Path,
        *,
        run_id: str = "chaos",
        engines: int = 1,
        rollout: int = 1,
        reward: int = 1,
    ):
        self.workdir = workdir
        self.model = model
        self.prompts = prompts
        self.run_id = run_id
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(workdir / "redis", appendonly=True)
        self.router = start_router(
            workdir, "--health-check-interval", str(HEALTH_INTERVAL_S), "--log-level", "warning"
        )
        self.coordinator_port = free_port()
        self.engines = [self.start_engine() for _ in range(engines)]
        self.workers = WorkerProcs(self.redis.url, run_id, workdir)
        for i in range(rollout):
            self.spawn_worker("rollout", f"rollout-{i}")
        for i in range(reward):
            self.spawn_worker("reward", f"reward-{i}")
        self.trainer_log = workdir / "trainer.log"
        self.run_dir = workdir / "run"
        self.trainers: list[subprocess.Popen] = []
        self.num_rollout = 0

    def start_engine(self, port: int | None = None) -> ServiceProcess:
        args = ["--model-path", str(self.model), "--num-threads", "1", "--weight-version", "0"]
        args += ["--coordinator", f"127.0.0.1:{self.coordinator_port}", "--log-level", "warning"]
        return ServiceProcess("engine", args, self.workdir, port=port)

    def spawn_worker(self, kind: str, name: str) -> None:
        self.workers.spawn(kind, name, ["--consumer-name", name, "--log-level", "warning"])

    def trainer_argv(self, num_rollout: int, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "millstream.cli", "train-async",
            "--hf-checkpoint", str(self.model), "--prompt-data", str(self.prompts),
            "--input-key", "prompt", "--label-key", "label",
            "--custom-rm-path", "tests.support.reward_plugins.misbehaving",
            "--reward-timeout", "1", "--reward-retries", "0",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--rollout-temperature", "1.0",
            "--num-rollout", str(num_rollout), "--lr", "1e-3",
            "--redis-url", self.redis.url, "--router-url", self.router.url, "--run-id", self.run_id,
            "--coordinator-port", str(self.coordinator_port), "--run-dir", str(self.run_dir),
            "--claim-idle-ms", str(CLAIM_IDLE_MS), "--max-deliveries", "3",
            "--trim-interval", "2", "--stall-timeout", "60", "--log-level", "warning",
            # An engine killed inside a sync leaves its peer waiting in the broken group for
            # the whole timeout (120 s by default); the tiny model's sync takes milliseconds.
            "--weight-sync-timeout", "20", *extra,
        ]  # fmt: skip

    def start_trainer(self, num_rollout: int, *extra: str) -> subprocess.Popen:
        self.num_rollout = num_rollout
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        with self.trainer_log.open("a") as log:
            trainer = subprocess.Popen(
                self.trainer_argv(num_rollout, *extra), cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.trainers.append(trainer)
        return trainer

    def iterations(self) -> int:
        """Iterations the trainer logged so far (all of its processes)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        return sum(1 for line in path.read_text().splitlines() if line.startswith('{"step"'))

    def wait_iterations(self, n: int, trainer: subprocess.Popen, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while self.iterations() < n:
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"the trainer did not reach iteration {n} (exit {trainer.poll()}):\n"
                    + self.trainer_log.read_text()[-3000:]
                )
            time.sleep(0.1)

    def finish(self, trainer: subprocess.Popen) -> RunResult:
        """Wait for the trainer's exit. One that has not ended a minute plus a second per
        iteration still to run (a few times what they take; inside the short tests' own
        timeout) prints its threads' and its asyncio tasks' stacks into its log (SIGUSR1,
        SIGUSR2) and is killed."""
        timeout_s = 60.0 + max(0, self.num_rollout - self.iterations())
        try:
            code = trainer.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            trainer.send_signal(signal.SIGUSR1)  # its threads' stacks
            time.sleep(0.5)
            trainer.send_signal(signal.SIGUSR2)  # its asyncio tasks' stacks
            time.sleep(1.0)
            trainer.kill()
            code = trainer.wait()
            with self.trainer_log.open("a") as log:
                log.write(f"\n[harness] the trainer hung for {timeout_s:g}s: killed\n")
        log = self.trainer_log.read_text(errors="replace")
        summary_path = self.run_dir / "summary.json"
        counts = json.loads(summary_path.read_text())["counts"] if summary_path.exists() else {}
        return RunResult(code, counts, trained_twice(self.run_dir / "metrics.jsonl"), log)

    def engine_eligible(self, url: str) -> bool:
        """Whether the router would send this engine a request now."""
        workers = httpx.get(f"{self.router.url}/workers", timeout=5).json()["workers"]
        return any(w["url"] == url and w.get("eligible") for w in workers)

    def engine_version(self, url: str) -> str:
        return httpx.get(f"{url}/get_weight_version", timeout=5).json()["weight_version"]

    def stop(self) -> None:
        for trainer in self.trainers:
            if trainer.poll() is None:
                trainer.kill()
            trainer.wait()
        self.workers.stop_all()
        for engine in self.engines:
            engine.stop()
        self.router.stop()
        self.redis.stop()


def trained_twice(metrics: Path) -> int:
    """Group ids trained more than once in the run's lineage: of the rows written for the same
    iteration (a trainer killed after it, and its successor resumed from an earlier
    checkpoint, wrote it again), the last one counts."""
    if not metrics.exists():
        return 0
    by_iteration: dict[int, list[str]] = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "step" in row:  # not a resumed trainer's `resumed_from` row
                by_iteration[int(row["step"])] = row.get("group_ids", [])
    seen = Counter(gid for ids in by_iteration.values() for gid in ids)
    return sum(n - 1 for n in seen.values() if n > 1)


def failed_groups(log: str) -> dict[str, str]:
    """Group id -> reason of every `group X failed: reason` line the trainer logged."""
    out = {}
    marker = "millstream.trainer.buffer: group "
    for line in log.splitlines():
        if marker in line and " failed" in line:
            gid, _, reason = line.split(marker, 1)[1].partition(" failed")
            out[gid.strip()] = reason.lstrip(": ").strip()
    return out
