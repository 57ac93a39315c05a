"""bench/bench_gpu.py's run section: examples/arith/run.sh (`make run`) with --colocate on
--device, in each of --arith-modes (sync: MODE=train; async: MODE=train-async), then, unless
--no-cpu-run, as `make run` runs it on the CPU.

A colocated run's engine gets `--sglang-max-total-tokens --arith-max-total-tokens`: the arith
job holds at most 128 rows of a prompt and 4 tokens (two 16-token pages each, 4096 tokens), so
a pool of 16384 leaves room for the prefix cache, while an uncapped pool on a 141 GB card is
hundreds of millions of tokens that every colocated resume allocates again. Each run's
RUN_DIR, console log and engine log stay in --run-dir (make gpu-check archives them); each
row is added as soon as its run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from gpu_bench_util import ARITH, REPO_ROOT, Row, progress

MODES = {"sync": "train", "async": "train-async"}  # --arith-modes -> run.sh's MODE
STOP_S = 15  # a run out of time: its trainer's stop (services included), then SIGKILL


class Refused(Exception):
    """`millstream train` refused a flag (its parser's error line)."""


def stop(proc: subprocess.Popen, wait_s: float) -> None:
    """run.sh hands SIGTERM to the trainer, which stops its services; what is left after
    `wait_s` is killed with run.sh's session (its own: start_new_session)."""
    proc.terminate()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def arith_run(mode: str, on_device: bool, args: argparse.Namespace, where: Path) -> dict:
    """One run.sh; its summary: seconds to the first eval >= 85%, completions/s, wall."""
    run_dir = where / f"arith-{mode}-{'dev' if on_device else 'cpu'}"
    env = {**os.environ, "MODE": MODES[mode], "RUN_DIR": str(run_dir),
           "NUM_ROLLOUT": str(args.arith_rollouts)}  # fmt: skip
    extra = ["--colocate"] if on_device else []
    if on_device and args.arith_max_total_tokens:
        extra += ["--sglang-max-total-tokens", str(args.arith_max_total_tokens)]
    if not on_device:
        env["CUDA_VISIBLE_DEVICES"] = ""
    log = where / f"{run_dir.name}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(ARITH / "run.sh"), *extra], cwd=REPO_ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(args.run_timeout)
        except subprocess.TimeoutExpired:
            stop(proc, STOP_S)
            raise RuntimeError(f"run.sh did not finish in {args.run_timeout:g} s") from None
        except KeyboardInterrupt:  # make gpu-check's stage limit: the services go down too
            stop(proc, 5)
            raise
    wall = time.perf_counter() - start
    if code != 0:
        lines = log.read_text(errors="replace").strip().splitlines()
        refused = [
            line for line in lines if line.startswith("millstream train") and "error:" in line
        ]
        if code == 2 and refused:  # argparse's exit: a flag not accepted (yet)
            raise Refused(refused[-1])
        raise RuntimeError(f"run.sh exited {code}: {' | '.join(lines[-3:])}")
    summary = json.loads((run_dir / "summary.json").read_text())
    first = [s for _, s, acc in summary["eval_curve"] if acc.get("arith", 0.0) >= 0.85]
    console = log.read_text(errors="replace")
    engine_log = run_dir / "logs" / "engine-0.log"
    engine_text = engine_log.read_text(errors="replace") if engine_log.is_file() else ""
    return {"to_85_s": first[0] if first else None, "completions_per_s":
            summary["completions_per_s"], "wall_s": wall,
            "best_eval": max((acc.get("arith", 0.0) for _, _, acc in summary["eval_curve"]),
                             default=None),
            "iterations": summary.get("iteration"), "rollouts": args.arith_rollouts,
            "max_total_tokens": args.arith_max_total_tokens if on_device else None,
            "routes": sorted(set(re.findall(r"weight transport to \S+: ([^\n]+)", console))),
            "graph_captures": engine_text.count("captured the decode step"),
            "tracebacks": console.count("Traceback") + engine_text.count("Traceback")}  # fmt: skip


def run_section(args: argparse.Namespace, where: Path, add: Callable[..., None]) -> None:
    """Per mode: run.sh as `make run` on the CPU (unless --no-cpu-run), then with --colocate
    on --device (its speed-up to the CPU's beside it), each row added when its run ends. A
    refused --colocate ends the section at once: every row says why, nothing else runs."""
    device = "GPU" if args.device == "cuda" else "CPU"
    for label in args.arith_modes:
        cpu: dict = {}
        for on_device in (False, True) if not args.no_cpu_run else (True,):
            name = f"arith {label}, " + (f"{device} --colocate" if on_device else
                                         "CPU as `make run`")  # fmt: skip
            progress(f"run: {name}, {args.arith_rollouts} rollouts ...")
            try:
                r = arith_run(label, on_device, args, where)
            except Refused as why:
                add(*[Row("run", f"arith {m}, {device} --colocate", None, "s to 85%",
                          note=f"not run: {why}") for m in args.arith_modes])  # fmt: skip
                return
            except (RuntimeError, OSError) as err:
                add(Row("run", name, None, "s to 85%", note=f"failed: {err}"))
                continue
            if not on_device:
                cpu = r
            t, cps = r["to_85_s"], r["completions_per_s"]
            ratio = cpu["to_85_s"] / t if t and cpu.get("to_85_s") else None
            detail = f"{cps:.0f} completions/s"
            if cpu.get("completions_per_s"):
                detail += f" ({cps / cpu['completions_per_s']:.2f}x CPU's)"
            add(Row("run", name, t, "s to 85%", ratio, "CPU (speed-up)",
                    f"{detail}; command {r['wall_s']:.0f} s", extra=r,
                    note="" if t else "85% not reached"))  # fmt: skip
