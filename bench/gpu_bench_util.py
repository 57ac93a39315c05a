"""What bench/bench_gpu.py's sections share: the row, the device helpers, and the results file
written after every row.

A GPU window is short and `make gpu-check` stops a stage that runs out of time; the results
file therefore holds every row measured so far, rewritten after each one (to a temp file, then
renamed over the old one: a stage killed mid-write leaves the previous whole file, never half
of one), with `done` false until the last section has run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
ARITH = REPO_ROOT / "examples" / "arith"


@dataclass
class Row:
    section: str
    name: str
    value: float | None  # None: not run (note says why)
    unit: str
    ratio: float | None = None
    base: str = ""  # what the ratio is to
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""


class Results:
    """The rows so far; `add` writes them to `path` at once (module docstring), with the
    goals `goals(rows)` judges, the resources and the settings."""

    def __init__(
        self, path: Path | None, settings: dict[str, Any], goals: Callable[[list[Row]], list]
    ):
        self.path, self.settings, self.goals = path, settings, goals
        self.rows: list[Row] = []
        self.resources: dict[str, Any] = {}

    def add(self, *rows: Row) -> None:
        self.rows += rows
        self.write()

    def write(self, done: bool = False) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"resources": self.resources, "settings": self.settings, "done": done,
                "rows": [asdict(r) for r in self.rows], "goals": self.goals(self.rows)}  # fmt: skip
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)


def progress(message: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync_device(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None


def best_of(step: Callable[[], Any], repeats: int, device: str) -> float:
    """The fastest of `repeats` calls of `step`, after a warm-up one."""
    step()
    times = []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        step()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return min(times)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(count)]


def num(x: float) -> str:
    """Three significant digits or more: 12,345 / 123 / 1.23 / 0.0123."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"
