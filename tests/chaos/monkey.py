"""`make chaos-monkey`: random faults on the arith job for as long as it trains, and a table
computed from the run.

    python -m tests.chaos.monkey                     # seeds 1, 2, 3 (about an hour on 2 cores)
    python -m tests.chaos.monkey --seeds 7 --iterations 300

Each seed deploys the arith job (examples/arith/run.sh, `train-async`) service by service on
loopback, as compose runs it (tests/chaos/harness.py: Redis with its AOF, the router, one
engine joining through the trainer's Coordinator, two rollout workers and a reward worker, and
the trainer given --redis-url and --router-url). Every --every-s seconds, on a schedule drawn
from the seed, one process picked at random among them is SIGKILLed and started again 0-5 s
later, as a restart policy would (a killed trainer resumes from its latest checkpoint), or
SIGSTOPped for 5-30 s. A trainer that exits non-zero by itself is a broken promise, and is
started again as `restart: on-failure` would. The faults go on until the run has trained
every iteration. Then the same run without faults gives the eval band.

Every promise is computed from the run's own files (summary.json, metrics.jsonl, the logs):
exit 0 with a summary; admitted == trained + filtered + failed + dropped (0 lost); no group id
trained twice across the trainer's restarts; the last eval within EVAL_BAND of the fault-free
run's; no gap between two iterations longer than STALL_BOUND_S.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.router_proc import ROOT, ServiceProcess

from .harness import HEALTH_INTERVAL_S, Deployment, RunResult
from .restarts import Stalls

ARITH = ROOT / "examples" / "arith"
KILL_DOWN_S = (0.0, 5.0)  # a killed process is started again after this long
STOP_S = (5.0, 30.0)  # a stopped one is continued after this long
STOP_SHARE = 0.35  # of the faults
EVAL_BAND = 0.10  # |last eval under faults - last eval without|, accuracy
# The longest stop (30 s), a trainer restart on 2 cores (imports, model, resume sync: ~20 s)
# and the keeper's look at a returning engine, with room.
STALL_BOUND_S = 90.0
TARGETS = ("rollout-0", "rollout-1", "reward-0", "engine", "router", "redis", "trainer")


class ArithDeployment(Deployment):
    """The harness's deployment with examples/arith/run.sh as the trainer (its model, data,
    reward and eval), resuming from its own checkpoints."""

    def __init__(self, workdir: Path, seed: int, iterations: int):
        super().__init__(workdir, ARITH / "model", ARITH / "data" / "train.jsonl", rollout=2)
        self.seed, self.num_rollout = seed, iterations

    def trainer_argv(self, num_rollout: int, *extra: str) -> list[str]:
        ckpt = str(self.run_dir / "ckpt")
        return [
            "bash", str(ARITH / "run.sh"),
            "--redis-url", self.redis.url, "--router-url", self.router.url,
            "--run-id", self.run_id, "--coordinator-port", str(self.coordinator_port),
            "--load", ckpt, "--save-interval", "10", "--rollout-seed", str(self.seed),
            "--claim-idle-ms", "2000", "--stall-timeout", "120", "--weight-sync-timeout", "20",
            "--num-rollout", str(num_rollout), *extra,
        ]  # fmt: skip

    def start_trainer(self, num_rollout: int, *extra: str) -> subprocess.Popen:
        self.num_rollout = num_rollout
        env = {
            **os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "MODE": "train-async",
            "COLOCATE": "0", "RUN_DIR": str(self.run_dir),
            "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        }  # fmt: skip
        with self.trainer_log.open("a") as log:
            # A session of its own: run.sh and the trainer it starts get each signal together,
            # as a container's processes do (`docker kill`).
            trainer = subprocess.Popen(
                self.trainer_argv(num_rollout, *extra), cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.trainers.append(trainer)
        return trainer

    def pid(self, target: str) -> subprocess.Popen:
        if target == "engine":
            return self.engines[0].proc
        if target == "router":
            return self.router.proc
        if target == "redis":
            return self.redis.proc
        if target == "trainer":
            return self.trainers[-1]
        return self.workers.procs[target]

    def signal(self, target: str, sig: int) -> None:
        """`sig` to `target`; to the trainer's whole session (run.sh and the trainer)."""
        proc = self.pid(target)
        if proc.poll() is not None and target != "trainer":
            return
        if target == "trainer":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)

    def kill(self, target: str) -> None:
        self.signal(target, signal.SIGKILL)
        self.pid(target).wait()

    def restart(self, target: str) -> None:
        """Start `target` again, as its restart policy would (nothing waits for it)."""
        if target == "engine":
            self.engines[0].stop()  # its log closed
            self.engines[0] = self.start_engine(port=self.engines[0].port)
        elif target == "router":
            self.router.stop()
            args = ["--health-check-interval", str(HEALTH_INTERVAL_S), "--log-level", "warning"]
            self.router = ServiceProcess("router", args, self.workdir, port=self.router.port)
        elif target == "redis":
            self.redis.start()
        elif target == "trainer":
            self.start_trainer(self.num_rollout)
        else:
            self.spawn_worker(target.split("-")[0], target)


@dataclass
class Fault:
    at_s: float  # since the run started
    target: str
    action: str  # "SIGKILL" or "SIGSTOP"
    hold_s: float  # down, or stopped, this long


@dataclass
class MonkeyRun:
    seed: int
    faults: list[Fault] = field(default_factory=list)
    result: RunResult | None = None
    longest_stall_s: float = 0.0
    seconds: float = 0.0
    trainer_starts: int = 1
    self_exits: list[str] = field(default_factory=list)  # the trainer's own non-zero exits
    last_eval: float | None = None


def schedule(rng: random.Random) -> Fault:
    target = rng.choice(TARGETS)
    if rng.random() < STOP_SHARE:
        return Fault(0.0, target, "SIGSTOP", rng.uniform(*STOP_S))
    return Fault(0.0, target, "SIGKILL", rng.uniform(*KILL_DOWN_S))


def last_eval(metrics: Path) -> float | None:
    """The last eval/arith accuracy the run logged (its lineage's last row that has one)."""
    found = None
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            if '"eval/arith"' in line:
                found = float(json.loads(line)["eval/arith"])
    return found


def run_seed(
    workdir: Path, seed: int, iterations: int, every_s: float | None, limit_s: float,
    say: Callable[[str], None] = print,
) -> MonkeyRun:  # fmt: skip
    """One arith run under the monkey (every_s None: without faults)."""
    d = ArithDeployment(workdir, seed, iterations)
    out, rng = MonkeyRun(seed), random.Random(seed)
    held: dict[str, tuple[float, str]] = {}  # target -> (when it comes back, how)
    start = time.monotonic()
    try:
        d.start_trainer(iterations)
        stalls = Stalls(d)
        next_fault = start + (every_s or 0.0)
        while True:
            now = time.monotonic()
            for target, (back_at, how) in list(held.items()):
                if now >= back_at:
                    del held[target]
                    if how == "SIGSTOP":
                        d.signal(target, signal.SIGCONT)
                    else:
                        d.restart(target)
                        out.trainer_starts += target == "trainer"
            trainer = d.trainers[-1]
            if "trainer" not in held and trainer.poll() is not None:
                if trainer.returncode == 0:
                    break
                out.self_exits.append(f"exit {trainer.returncode} at {now - start:.0f} s")
                say(f"[monkey] the trainer exited {trainer.returncode} by itself: restarted")
                d.restart("trainer")
                out.trainer_starts += 1
            if now - start > limit_s:
                raise AssertionError(f"seed {seed}: not finished within {limit_s:.0f} s")
            if every_s is not None and now >= next_fault:
                next_fault += every_s
                fault = schedule(rng)
                if fault.target not in held and d.pid(fault.target).poll() is None:
                    fault.at_s = now - start
                    if fault.action == "SIGSTOP":
                        d.signal(fault.target, signal.SIGSTOP)
                    else:
                        d.kill(fault.target)
                    held[fault.target] = (now + fault.hold_s, fault.action)
                    out.faults.append(fault)
                    say(
                        f"[monkey] {fault.at_s:5.0f} s  {fault.action} {fault.target} for "
                        f"{fault.hold_s:.1f} s  (iteration {d.iterations()})"
                    )
            time.sleep(0.1)
        out.seconds = time.monotonic() - start
        out.longest_stall_s = stalls.stop()
        out.result = d.finish(d.trainers[-1])
        out.last_eval = last_eval(d.run_dir / "metrics.jsonl")
        return out
    finally:
        for target, (_, how) in held.items():
            if how == "SIGSTOP":
                d.signal(target, signal.SIGCONT)
        for trainer in d.trainers:  # run.sh's trainer, which the harness's stop does not reach
            with contextlib.suppress(ProcessLookupError):
                os.killpg(trainer.pid, signal.SIGKILL)
        d.stop()


def problems(run: MonkeyRun, clean: MonkeyRun | None) -> list[str]:
    found = list(run.self_exits)
    r = run.result
    if r is None or not r.counts:
        return [*found, "no summary.json"]
    if r.returncode != 0:
        found.append(f"the last trainer exited {r.returncode}")
    if r.lost:
        found.append(f"{r.lost} groups lost: {r.counts}")
    if r.trained_twice:
        found.append(f"{r.trained_twice} groups trained twice")
    if run.longest_stall_s > STALL_BOUND_S:
        found.append(f"a stall of {run.longest_stall_s:.0f} s > {STALL_BOUND_S:g} s")
    if clean is not None and (run.last_eval is None or clean.last_eval is None):
        found.append("no eval")
    elif clean is not None and abs(run.last_eval - clean.last_eval) > EVAL_BAND:  # type: ignore[operator]
        found.append(f"eval {run.last_eval:.3f} vs {clean.last_eval:.3f} without faults")
    return found


def table(
    rows: list[tuple[MonkeyRun, MonkeyRun | None]], faults: str = "faults (kill/stop)"
) -> str:
    head = ["seed", faults, "trainer starts", "admitted", "terminal", "lost",
            "trained twice", "longest stall", "eval (no faults)", "minutes", "ok"]  # fmt: skip
    body = []
    for run, clean in rows:
        c = run.result.counts if run.result else {}
        terminal = sum(c.get(k, 0) for k in ("trained", "filtered", "failed"))
        terminal += c.get("dropped_stale", 0) + c.get("dropped_at_end", 0)
        kills = sum(f.action == "SIGKILL" for f in run.faults)
        body.append([
            str(run.seed), f"{len(run.faults)} ({kills}/{len(run.faults) - kills})",
            str(run.trainer_starts), str(c.get("admitted", "-")), str(terminal),
            str(run.result.lost if run.result else "-"),
            str(run.result.trained_twice if run.result else "-"),
            f"{run.longest_stall_s:.1f} s",
            f"{run.last_eval if run.last_eval is not None else '-'} "
            f"({clean.last_eval if clean and clean.last_eval is not None else '-'})",
            f"{run.seconds / 60:.1f}", "yes" if not problems(run, clean) else "NO",
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in body
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.monkey", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated (default 1,2,3)")
    parser.add_argument(
        "--iterations",
        type=int,
        default=400,
        help="the run's --num-rollout (400: ~10 min with faults)",
    )
    parser.add_argument("--every-s", type=float, default=10.0, help="seconds between faults")
    parser.add_argument("--no-clean", action="store_true", help="skip the fault-free runs")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs' files here")
    args = parser.parse_args(argv)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-monkey-"))
    limit_s = 3600.0
    rows: list[tuple[MonkeyRun, MonkeyRun | None]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        print(
            f"[monkey] seed {seed}: {args.iterations} iterations, a fault every {args.every_s:g} s; files in {base}",
            flush=True,
        )
        run = run_seed(base / f"seed{seed}", seed, args.iterations, args.every_s, limit_s)
        clean = None
        if not args.no_clean:
            print(f"[monkey] seed {seed}: the same run without faults", flush=True)
            clean = run_seed(
                base / f"seed{seed}-clean", seed, args.iterations, None, limit_s, say=lambda _: None
            )
        rows.append((run, clean))
        for line in problems(run, clean):
            print(f"[monkey] seed {seed}: {line}", flush=True)
    print(table(rows))
    print(f"stall bound {STALL_BOUND_S:g} s; eval band +-{EVAL_BAND:g}; commit {commit()}")
    return 0 if all(not problems(r, c) for r, c in rows) else 1


def commit() -> str:
    """The short hash of HEAD, "?" without git."""
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "?"
        )
    except OSError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
