"""A run's metrics.jsonl read as one history, across the trainer processes that wrote it.

Each trainer process appends one row per iteration, `{"step": N, ...}` (metrics.py). A trainer
resumed with --load from the checkpoint of iteration C first appends a resume row:

    {"resumed_from": C, "discarded_iterations": [C+1, ...], "discarded_trained": G, "time": T}

The discarded iterations are those the process before it logged after C (it was killed before
it saved them): their weights were lost with it, the resumed process trains and logs those
iterations again, and G counts the groups their rows trained (their `group_ids`). Nothing is
deleted: the old rows stay where they were, told apart from their successors by the resume row
between them.

`read` gives the rows of the history as it stands (an iteration's last row, those a resume
discarded left out) and the resume rows; plot.py, the summary and the trainer's resume read
the file through it. A row whose step does not follow the last one without a resume row
between them starts a new history: a fresh run in a reused --run-dir.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from millstream.common.errors import MillstreamError

RESUMED_FROM = "resumed_from"


@dataclass
class History:
    rows: list[dict[str, Any]] = field(default_factory=list)  # by step, as the run stands
    resumes: list[dict[str, Any]] = field(default_factory=list)  # the resume rows, in order

    def resume_row(self, iteration: int) -> dict[str, Any]:
        """The row a trainer resumed from the checkpoint of `iteration` appends."""
        discarded = [row for row in self.rows if row["step"] > iteration]
        return {
            RESUMED_FROM: iteration,
            "discarded_iterations": [row["step"] for row in discarded],
            "discarded_trained": sum(len(row.get("group_ids") or ()) for row in discarded),
            "time": time.time(),
        }


def read(path: Path, *, strict: bool = True) -> History:
    """The history in `path` (none when it does not exist). A last line without its newline is
    being written and is left out; any other line that is not a row is a MillstreamError
    naming the file and line, or skipped when not `strict` (a trainer starting on a file that
    a crash left behind)."""
    if not path.is_file():
        return History()
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    live: dict[int, dict[str, Any]] = {}
    resumes: list[dict[str, Any]] = []
    last: float | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = _parse(line)
        except ValueError as err:
            if number == len(lines) and not text.endswith("\n"):
                break
            if strict:
                raise MillstreamError(f"{path}:{number}: {err}") from None
            continue
        if RESUMED_FROM in row:
            start = row[RESUMED_FROM]
            live = {step: r for step, r in live.items() if step <= start}
            resumes.append(row)
            last = start
            continue
        if last is not None and row["step"] <= last:
            live, resumes = {}, []
        live[row["step"]] = row
        last = row["step"]
    return History([live[step] for step in sorted(live)], resumes)


def _parse(line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg})") from None
    if isinstance(row, dict) and _number(row.get(RESUMED_FROM)) is not None:
        return row
    if not isinstance(row, dict) or _number(row.get("step")) is None:
        raise ValueError("not a metrics row (no numeric 'step')")
    return row


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if math.isfinite(value) else None


def end_partial_line(path: Path) -> None:
    """Cut a last line without its newline (a trainer killed while writing it), so that the
    next row appended starts a line of its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)
