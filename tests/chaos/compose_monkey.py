"""`make chaos-monkey-compose`: the chaos monkey (tests/chaos/monkey.py) under docker compose.

    python -m tests.chaos.compose_monkey                 # seed 1, 400 iterations, a clean twin
    python -m tests.chaos.compose_monkey --seeds 2 --iterations 60 --no-clean

The arith job as `make compose-up` runs it (deploy/compose/compose.yml, profile cpu, two rollout
replicas), in a project of its own. Every --every-s seconds, on a schedule drawn from the seed,
one container picked at random among redis, router, engine, rollout, reward and trainer is
either killed (SIGKILL to its main process from the host: a crash, which the services'
`restart: on-failure` answers) or frozen with `docker pause` for 5-30 s. The trainer has no
restart policy (a finished run must not start again), so the monkey starts a killed trainer
again 0-5 s later itself, as a supervisor would; it resumes from its checkpoints
(TRAINER_ARGS="--load /runs/arith/ckpt": run.sh then keeps the run dir).

The promises and the table are monkey.py's, computed from the run's files read from the runs
volume: exit 0 with a summary, admitted == terminal states, no group trained twice, the last
eval within the band of the same run without faults, no stall past the bound. Needs a Docker
daemon (scripts/compose_smoke.sh starts one); not part of `make test`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from tests.support.router_proc import ROOT

from .harness import RunResult
from .monkey import EVAL_BAND, STALL_BOUND_S, MonkeyRun, commit, problems, schedule, table

COMPOSE = ROOT / "deploy" / "compose" / "compose.sh"
SERVICES = ("redis", "router", "engine", "rollout", "reward", "trainer")
ITERATION = re.compile(r"\[trainer\] iter (\d+)/")

# Read in a container of the image, on the runs volume: what monkey.py reads from local files.
RESULTS = """
import json, os
from collections import Counter
run = "/runs/" + os.environ.get("MILLSTREAM_RUN_ID", "arith")
summary = json.load(open(run + "/summary.json")) if os.path.exists(run + "/summary.json") else {}
by_iteration, last_eval = {}, None
for line in open(run + "/metrics.jsonl"):
    row = json.loads(line)
    if "step" in row:
        by_iteration[int(row["step"])] = row.get("group_ids", [])
    if "eval/arith" in row:
        last_eval = float(row["eval/arith"])
seen = Counter(g for ids in by_iteration.values() for g in ids)
print(json.dumps({"counts": summary.get("counts", {}), "last_eval": last_eval,
                  "trained_twice": sum(n - 1 for n in seen.values() if n > 1)}))
"""


class Stack:
    """One compose project of the arith job; every call through deploy/compose/compose.sh."""

    def __init__(self, project: str, iterations: int, seed: int):
        self.env = {
            **os.environ, "COMPOSE_PROJECT_NAME": project, "COMPOSE_PROFILES": "cpu",
            "NUM_ROLLOUT": str(iterations), "MODE": "train-async",
            "TRAINER_ARGS": f"--load /runs/arith/ckpt --save-interval 10 --rollout-seed {seed} "
            "--claim-idle-ms 2000 --stall-timeout 120 --weight-sync-timeout 20",
        }  # fmt: skip

    def dc(self, *args: str, capture: bool = False) -> str:
        done = subprocess.run(
            ["bash", str(COMPOSE), *args], env=self.env, check=True, text=True,
            stdout=subprocess.PIPE if capture else subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return done.stdout or ""

    def up(self) -> None:
        self.dc("up", "-d", "--scale", "rollout=2")

    def down(self) -> None:
        subprocess.run(
            ["bash", str(COMPOSE), "down", "-v", "--remove-orphans"], env=self.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
        )  # fmt: skip

    def containers(self, service: str) -> list[str]:
        return self.dc("ps", "-aq", service, capture=True).split()

    def state(self, container: str) -> tuple[str, int]:
        out = docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", container)
        status, code = out.split()
        return status, int(code)

    def crash(self, container: str) -> None:
        """SIGKILL to the container's main process from the host: it exits 137 and its
        restart policy applies (`docker kill` counts as a manual stop: no restart)."""
        pid = int(docker("inspect", "-f", "{{.State.Pid}}", container))
        if pid > 0:
            os.kill(pid, signal.SIGKILL)

    def iteration(self) -> int:
        (trainer,) = self.containers("trainer")
        out = subprocess.run(
            ["docker", "logs", "--tail", "200", trainer], capture_output=True, text=True
        )
        found = ITERATION.findall(out.stdout + out.stderr)
        return int(found[-1]) if found else 0

    def results(self, returncode: int) -> tuple[RunResult, float | None]:
        out = subprocess.run(
            ["bash", str(COMPOSE), "run", "--rm", "--no-deps", "-T", "router", "python3", "-"],
            input=RESULTS, env=self.env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        found = json.loads(out.stdout.strip().splitlines()[-1])
        (trainer,) = self.containers("trainer")
        log = subprocess.run(["docker", "logs", trainer], capture_output=True, text=True)
        result = RunResult(returncode, found["counts"], found["trained_twice"], log.stdout)
        return result, found["last_eval"]


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True).stdout


def run_seed(
    seed: int, iterations: int, every_s: float | None, limit_s: float,
    say: Callable[[str], None] = print,
) -> MonkeyRun:  # fmt: skip
    """One arith run under compose, with the monkey (every_s None: without faults)."""
    stack = Stack(f"millstream-monkey-{os.getpid()}-{seed}", iterations, seed)
    out, rng = MonkeyRun(seed), random.Random(seed)
    held: dict[str, tuple[float, str, str]] = {}  # container -> (back at, action, service)
    stack.down()
    stack.up()
    start = last_change = time.monotonic()
    last_iteration = 0
    try:
        (trainer,) = stack.containers("trainer")
        next_fault = start + (every_s or 0.0)
        while True:
            now = time.monotonic()
            for container, (back_at, action, service) in list(held.items()):
                if now >= back_at:
                    del held[container]
                    if action == "SIGSTOP":
                        docker("unpause", container)
                    elif service == "trainer":
                        docker("start", container)
                        out.trainer_starts += 1
            status, code = stack.state(trainer)
            if trainer not in held and status == "exited":
                if code == 0:
                    break
                out.self_exits.append(f"exit {code} at {now - start:.0f} s")
                say(f"[monkey] the trainer exited {code} by itself: started again")
                docker("start", trainer)
                out.trainer_starts += 1
            if now - start > limit_s:
                raise AssertionError(f"seed {seed}: not finished within {limit_s:.0f} s")
            if status == "running" and trainer not in held:
                iteration = stack.iteration()
                if iteration != last_iteration:
                    out.longest_stall_s = max(out.longest_stall_s, now - last_change)
                    last_iteration, last_change = iteration, now
            if every_s is not None and now >= next_fault:
                next_fault += every_s
                fault = schedule(rng)
                service = fault.target.split("-")[0]  # monkey.py's names: rollout-0, reward-0
                running = [c for c in stack.containers(service) if stack.state(c)[0] == "running"]
                if running and not held.keys() & set(running):
                    container = rng.choice(running)
                    fault.at_s = now - start
                    if fault.action == "SIGSTOP":
                        docker("pause", container)
                        held[container] = (now + fault.hold_s, fault.action, service)
                    elif service == "trainer":
                        docker("kill", container)  # no restart policy: started again above
                        held[container] = (now + fault.hold_s, fault.action, service)
                    else:
                        stack.crash(container)  # its restart policy brings it back
                    out.faults.append(fault)
                    say(
                        f"[monkey] {fault.at_s:5.0f} s  {fault.action} {service} {container[:12]}"
                        f" (iteration {last_iteration})"
                    )
            time.sleep(1.0)
        out.seconds = time.monotonic() - start
        out.result, out.last_eval = stack.results(0)
        return out
    finally:
        for container, (_, action, _) in held.items():
            if action == "SIGSTOP":
                subprocess.run(["docker", "unpause", container], capture_output=True)
        stack.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.compose_monkey", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seeds", default="1", help="comma-separated (default 1)")
    parser.add_argument(
        "--iterations", type=int, default=400, help="NUM_ROLLOUT (400: ~10 min with faults)"
    )
    parser.add_argument("--every-s", type=float, default=10.0, help="seconds between faults")
    parser.add_argument("--no-clean", action="store_true", help="skip the fault-free runs")
    args = parser.parse_args(argv)
    subprocess.run(["bash", str(ROOT / "deploy" / "compose" / "prepare.sh")], check=True)
    env = {**os.environ, "COMPOSE_PROFILES": "cpu"}
    subprocess.run(["bash", str(COMPOSE), "build"], check=True, env=env)
    rows: list[tuple[MonkeyRun, MonkeyRun | None]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        print(f"[monkey] compose, seed {seed}: {args.iterations} iterations", flush=True)
        run = run_seed(seed, args.iterations, args.every_s, 3600.0)
        clean = None
        if not args.no_clean:
            print(f"[monkey] compose, seed {seed}: the same run without faults", flush=True)
            clean = run_seed(seed, args.iterations, None, 3600.0, say=lambda _: None)
        rows.append((run, clean))
        for line in problems(run, clean):
            print(f"[monkey] seed {seed}: {line}", flush=True)
    print(table(rows, faults="container faults (crash/pause)"))
    print(
        f"under compose; stall bound {STALL_BOUND_S:g} s; eval band +-{EVAL_BAND:g}; "
        f"commit {commit()}"
    )
    return 0 if all(not problems(r, c) for r, c in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
