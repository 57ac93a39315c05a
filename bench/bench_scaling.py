"""Scaling one service at a time: completions/s of the same run with 1, 2, 4 rollout workers
and 1, 2 engines, as local processes (what `docker compose up --scale` does with containers).

    .venv/bin/python bench/bench_scaling.py [--rollouts 20] [--mode train-async]

Each row is the arith example (`examples/arith/run.sh`: 64 prompts x 8 samples per rollout)
for --rollouts rollouts, no eval (an interval past the end), one after another on this machine; completions/s is the
trainer's own (median step). Ratios are against 1 rollout worker and 1 engine. On a machine
with few cores every added process shares the same cores: read where the curve flattens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]  # (rollout workers, engines)


def run(rollout_workers: int, engines: int, rollouts: int, mode: str, tmp: Path) -> dict:
    run_dir = tmp / f"r{rollout_workers}-e{engines}"
    env = {
        **os.environ,
        "RUN_DIR": str(run_dir),
        "NUM_ROLLOUT": str(rollouts),
        "MODE": mode,
        "MILLSTREAM": str(ROOT / ".venv" / "bin" / "millstream"),
    }
    argv = [
        "bash", str(ROOT / "examples" / "arith" / "run.sh"),
        "--num-rollout-workers", str(rollout_workers), "--rollout-num-engines", str(engines),
        "--eval-interval", "1000000", "--skip-eval-before-train", "--run-id", f"scale-{rollout_workers}-{engines}",
    ]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{argv} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"cps": summary["completions_per_s"], "wall_s": time.monotonic() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20)
    parser.add_argument("--mode", default="train-async", choices=("train", "train-async"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers, engines in SHAPES:
            result = run(workers, engines, args.rollouts, args.mode, Path(tmp))
            rows.append((workers, engines, result))
            print(f"{workers} rollout, {engines} engine: {result['cps']:.0f} c/s", flush=True)
    base = rows[0][2]["cps"]
    print(f"\n| {args.mode}, {os.cpu_count()} cores | completions/s | ratio | wall s |")
    print("|---|---|---|---|")
    for workers, engines, r in rows:
        print(
            f"| {workers} rollout worker(s), {engines} engine(s) | {r['cps']:.0f} | "
            f"{r['cps'] / base:.2f}x | {r['wall_s']:.1f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
