"""The arith job (examples/arith/run.sh, a Miles launch script) as the live tier runs it: a
short run, its output, metrics, summary and eval curve.

    run = arith_run(tmp_path / "run", "train-async", 10, "--router-url", url)
    run.ok(), run.evals, run.counts, run.rows, run.out
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.sglang_live.server import REPO, STANDIN

SCRIPT = REPO / "examples" / "arith" / "run.sh"
TERMINAL = ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end")


@dataclass
class ArithRun:
    run_dir: Path
    proc: subprocess.CompletedProcess[str]

    @property
    def out(self) -> str:
        return self.proc.stdout + self.proc.stderr

    @property
    def rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return (
            [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        )

    @property
    def counts(self) -> dict[str, int]:
        return json.loads((self.run_dir / "summary.json").read_text())["counts"]

    @property
    def evals(self) -> dict[int, float]:
        """Greedy accuracy on the eval set, by iteration (0: before training)."""
        curve = json.loads((self.run_dir / "summary.json").read_text())["eval_curve"]
        return {it: acc["arith"] for it, _, acc in curve}

    def ok(self) -> ArithRun:
        """The run ended with exit 0, every admitted group in one terminal state, none lost,
        and every step with a gradient."""
        assert self.proc.returncode == 0, self.out[-5000:]
        c = self.counts
        assert c["admitted"] == sum(c[k] for k in TERMINAL), c
        assert c["in_flight_lost"] == 0 and c["duplicates_ignored"] == 0, c
        steps = [r for r in self.rows if "grad_norm" in r]
        assert steps and all(r["grad_norm"] > 0 for r in steps), steps
        return self


def arith_run(
    run_dir: Path,
    mode: str,
    num_rollout: int,
    *flags: str,
    sglang_python: str | None = None,
    timeout_s: float = 600,
) -> ArithRun:
    """run.sh in `mode` for `num_rollout` rollouts, evaluated every 5, with `flags` last. With
    `sglang_python`, engines the launcher starts are SGLang servers on that Python (with the
    kernel stand-in on their path); without it, millstream's own."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        "RUN_DIR": str(run_dir),
        "NUM_ROLLOUT": str(num_rollout),
        "MODE": mode,
        "COLOCATE": "0",
    }
    env.pop("MILLSTREAM_SGLANG_PYTHON", None)
    if sglang_python is not None:
        env["MILLSTREAM_SGLANG_PYTHON"] = sglang_python
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STANDIN), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        ["bash", str(SCRIPT), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
    return ArithRun(run_dir, proc)
