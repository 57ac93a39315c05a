"""`make chaos`: the chaos suite at full length, and its table.

    python -m tests.chaos            # every scenario (about 15 minutes on 2 cores)
    python -m tests.chaos poison     # the scenarios whose name contains "poison"

Each scenario deploys a run on loopback (tests/chaos/harness.py), injects its fault while
the trainer trains and checks the promises; the exit code is 1 when any promise broke.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.tiny_model import build_tiny_model

from . import restarts, scenarios
from .harness import Row

FULL: dict[str, Callable[[Path, Path], Row]] = {
    "workers_killed": lambda w, m: scenarios.workers_killed(w, m, iterations=1500, every_s=10.0),
    "engine_killed": lambda w, m: scenarios.engine_killed(w, m, iterations=600, kills=3),
    "trainer_killed": lambda w, m: scenarios.trainer_killed(w, m, iterations=120, save_interval=30),
    "redis_restarted": lambda w, m: scenarios.redis_restarted(w, m, iterations=300, restarts=3),
    "poison": lambda w, m: scenarios.poison(w, m, iterations=150, entries=30),
    "bad_input": scenarios.bad_input,
    "oversized_request": scenarios.oversized_request,
    "router_restarted": lambda w, m: restarts.router_restarted(w, m, iterations=300, restarts=2),
    "last_engine_replaced": lambda w, m: restarts.last_engine_replaced(
        w, m, iterations=300, gap_s=10.0
    ),
    "redis_down_30s": lambda w, m: restarts.redis_down(w, m, iterations=300, down_s=30.0),
    "redis_down_90s": lambda w, m: restarts.redis_down(w, m, iterations=300, down_s=90.0),
    "trainer_terminated": lambda w, m: restarts.trainer_terminated(w, m, iterations=120),
    "unauthenticated_admin": restarts.unauthenticated_admin,
}

COLUMNS = ("admitted", "trained", "filtered", "failed", "dropped", "lost", "trained twice")


def cells(row: Row) -> list[str]:
    r = row.result
    if r is None or not r.counts:
        return ["-"] * len(COLUMNS)
    c = r.counts
    dropped = c.get("dropped_stale", 0) + c.get("dropped_at_end", 0)
    values = [
        c["admitted"],
        c["trained"],
        c["filtered"],
        c["failed"],
        dropped,
        r.lost,
        r.trained_twice,
    ]
    return [str(v) for v in values]


def table(rows: list[tuple[Row, float]], first: str = "fault") -> str:
    """The Markdown table of `rows` (each with its seconds); `first` names the first column."""
    head = [first, "injected", "outcome", *COLUMNS, "longest stall", "seconds", "ok"]
    body = [
        [
            row.fault,
            str(row.injected),
            row.outcome,
            *cells(row),
            "-"
            if row.longest_stall_s is None
            else f"{row.longest_stall_s:.1f} s"
            + ("" if row.stall_bound_s is None else f" (<= {row.stall_bound_s:g})"),
            f"{secs:.0f}",
            "yes" if row.ok else "NO",
        ]
        for row, secs in rows
    ]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in body
    ]
    return "\n".join(lines)


def main(
    argv: list[str], suite: dict[str, Callable[[Path, Path], Row]] = FULL, first: str = "fault"
) -> int:
    """Run the scenarios of `suite` whose names contain an argument (all without one), each
    in a directory of its own, and print the table (`first`: its first column's name); 1 when
    any promise broke."""
    chosen = {k: v for k, v in suite.items() if not argv or any(a in k for a in argv)}
    rows: list[tuple[Row, float]] = []
    with tempfile.TemporaryDirectory(prefix="millstream-chaos-") as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        for name, scenario in chosen.items():
            print(f"== {name}", flush=True)
            workdir = Path(tmp) / name
            workdir.mkdir()
            start = time.monotonic()
            row = scenario(workdir, model)
            rows.append((row, time.monotonic() - start))
            for problem in row.problems:
                print(f"   problem: {problem[:2000]}", flush=True)
    print(table(rows, first))
    return 0 if all(row.ok for row, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
