"""RUN_DIR/summary.json: how a run of `millstream train` / `train-async` ended, on every exit.

    {"ended": "finished" | "signal SIGTERM" | "signal SIGINT" | "stall timeout: <why>"
              | "plugin failed: <n> groups in a row failed ...: <service>: <flag> <path> raised
                 <Type>: <message>" | "error: <type>: <message>",
     "exit_code": 0 | 130 | 1,
     "iteration": 12, "num_rollout": 300, "checkpoint": 10 (the latest under --save, or null),
     "counts": {"admitted", "trained", "filtered", "failed", "dropped_stale", "dropped_at_end",
                "in_flight", "in_flight_lost" (in_flight's older name), "duplicates_ignored",
                "dead_letters"},
     "in_flight_ids": ["e0-i17", ...],
     "resumes": [{"resumed_from": 10, "discarded_iterations": [11, 12], "discarded_trained": 4}],
     "eval_curve": [[iteration, seconds, {set: accuracy}], ...], "completions_per_s": 1234.5,
     "buffer_bytes": {"limit", "peak_counted", "holds", "group_bytes"} (with --max-buffer-bytes)}

The counts keep the trainer's invariant, also when a run stops half-way: admitted == trained +
filtered + failed + dropped_stale + dropped_at_end + in_flight (the groups admitted and not yet
in a terminal state; a checkpoint holds them and a resumed run admits them again). They are
the whole run's: a resumed trainer starts from its checkpoint's. `resumes` lists the resume
rows of metrics.jsonl (history.py); a run that failed before its trainer was built has zero
counts. The file is written last, after every service stopped, by trainer/main.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from millstream.common.errors import MillstreamError
from millstream.common.fencing import FencedOut

from ..evaluate import format_accuracies
from .history import RESUMED_FROM, read
from .plugin_failures import PluginCrashed
from .watch import Stalled

TERMINAL = ("trained", "filtered", "failed", "dropped_stale", "dropped_at_end")
FENCED_OUT_EXIT = FencedOut.exit_code  # another trainer holds the run (lost lease, or held)
INTERRUPTED = 130  # the CLI's exit code for a run stopped by a signal (as a shell's Ctrl-C)


def ended_by(err: BaseException | None, signal_name: str | None) -> tuple[str, int]:
    """("ended", exit code) of a run that raised `err` (None: it returned) after the signal
    `signal_name`, if any: an error raised while stopping is the error, and its exit code."""
    if isinstance(err, Exception):
        if isinstance(err, Stalled):
            return f"stall timeout: {err}", 1
        if isinstance(err, PluginCrashed):  # its traceback: on the console, not in here
            return f"plugin failed: {err.summary}", 1
        return f"error: {type(err).__name__}: {err}", getattr(err, "exit_code", 1)
    if signal_name is not None or isinstance(err, KeyboardInterrupt):
        return f"signal {signal_name or 'SIGINT'}", INTERRUPTED
    if err is not None:  # SystemExit and the like
        return f"error: {type(err).__name__}: {err}", 1
    return "finished", 0


class RunEnd:
    """What summary.json says, gathered while the run goes and written once on the way out."""

    def __init__(self, run_dir: str | Path, save_dir: str | None):
        self.run_dir = Path(run_dir)
        self.save_dir = save_dir
        self.state: dict[str, Any] = {"counts": dict.fromkeys(("admitted", *TERMINAL), 0)}
        self.state["counts"] |= {"in_flight": 0, "in_flight_lost": 0}
        self.state["in_flight_ids"] = []
        self._trainer: Any = None

    def watch(self, trainer: Any) -> None:
        """Count from `trainer` from now on (its state is read when the file is written, or
        when `take` freezes it)."""
        self._trainer = trainer

    def take(self) -> None:
        """Freeze the trainer's numbers now (its services are closed: nothing moves them)."""
        if self._trainer is not None:
            self.state = _trainer_state(self._trainer)
            self._trainer = None

    def write(self, ended: str, exit_code: int) -> dict[str, Any]:
        self.take()
        summary = {
            "ended": ended,
            "exit_code": exit_code,
            **self.state,
            "checkpoint": _latest_checkpoint(self.save_dir),
            "resumes": [
                {k: v for k, v in row.items() if k != "time"}
                for row in read(self.run_dir / "metrics.jsonl", strict=False).resumes
            ],
        }
        _print(summary)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "summary.json"
        if exit_code == FENCED_OUT_EXIT:
            # The run is another trainer's now (trainer/lease.py), which may share this run
            # dir and write the run's summary: this one's end goes beside it, never over it.
            path = self.run_dir / f"summary.lost-lease-{os.getpid()}.json"
            print(f"[trainer] this trainer's end: {path} (the run's summary is its holder's)")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, path)
        return summary


def _trainer_state(t: Any) -> dict[str, Any]:
    a = t.p.admission
    counts = {"admitted": a.counts.admitted, **{k: getattr(a.counts, k) for k in TERMINAL}}
    counts["in_flight"] = counts["in_flight_lost"] = len(a.in_flight)
    counts["duplicates_ignored"] = t.p.buffer.duplicates
    counts["earlier_run_dropped"] = t.p.buffer.earlier_run
    counts["dead_letters"] = t.p.buffer.dead_letters
    state = {
        "iteration": t.iteration,
        "num_rollout": t.num_rollout,
        "counts": counts,
        "in_flight_ids": sorted(a.in_flight),
        "eval_curve": [[it, round(secs, 1), acc] for it, secs, acc in t.eval_history],
        "completions_per_s": t.completions_per_s,
    }
    bound = getattr(a, "bytes", None)
    if bound is not None:  # --max-buffer-bytes (admission.py ByteBound)
        state["buffer_bytes"] = {
            "limit": bound.limit, "peak_counted": bound.peak, "holds": bound.holds,
            "group_bytes": bound.per_group,
        }  # fmt: skip
    return state


def _latest_checkpoint(save_dir: str | None) -> int | None:
    from ..checkpoints.checkpoint import latest_iteration  # no torch: a file read

    try:
        return latest_iteration(save_dir)
    except MillstreamError:  # a broken latest file: the summary still says how the run ended
        return None


def _print(summary: dict[str, Any]) -> None:
    c = summary["counts"]
    accounted = c["admitted"] == sum(c[k] for k in TERMINAL) + c["in_flight"]
    print(
        "[trainer] terminal states: " + " ".join(f"{k}={v}" for k, v in c.items())
        + f" (admitted == trained + filtered + failed + dropped + in flight: {accounted})"
    )  # fmt: skip
    for it, secs, acc in summary.get("eval_curve", ()):
        print(f"[trainer] eval curve: iter {it:>4} at {secs:>7.1f}s  {format_accuracies(acc)}")
    if "completions_per_s" in summary:
        print(f"[trainer] completions/s: {summary['completions_per_s']:.1f}")
    for r in summary["resumes"]:
        print(
            f"[trainer] resumed from iteration {r[RESUMED_FROM]}: discarded iterations "
            f"{r['discarded_iterations']} ({r['discarded_trained']} groups trained there)"
        )
    print(f"[trainer] ended: {summary['ended']} (exit code {summary['exit_code']})", flush=True)
