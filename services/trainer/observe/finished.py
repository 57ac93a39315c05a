"""A finished run stays finished: `millstream train` given the --run-dir of a run of the same
--run-id whose summary.json says "ended": "finished" prints one line saying so (when, where
its summary is, how to run again) and exits 0, before anything starts.

Why in the trainer, not only in examples/arith/run.sh: whatever starts the trainer's command
again after its run finished, whether an orchestrator restarting an exited container (a
second `docker compose up`), a job scheduler's retry or a user's own Miles launch script run
twice, would otherwise train the run again over its own files (metrics.jsonl appended to, the
summary and the checkpoints of the same iterations replaced). Exit 0, not an error: the
command's work is done.

Asked to run again, it trains: RERUN=1 in the environment (the name run.sh takes too; it
moves the old files aside first, this trains over them in place), another --run-id, or
--load with a --num-rollout past the finished run's last iteration (Miles' way to train a
finished run on from its checkpoint). Torch-free: read before preflight, in a second.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from millstream.common.config import RunConfig

RERUN = "RERUN"  # the environment variable: set and not "0", run a finished run again


def rerun_asked() -> bool:
    return os.environ.get(RERUN, "") not in ("", "0")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _run_id(run_dir: Path) -> str | None:
    """The run id in RUN_DIR/config.json (common/config/store.py writes it at start)."""
    config = (_read(run_dir / "config.json") or {}).get("config")
    connection = config.get("connection") if isinstance(config, dict) else None
    return connection.get("run_id") if isinstance(connection, dict) else None


def finished_line(cfg: RunConfig) -> str | None:
    """The line to print instead of training when `cfg` would run a finished run again;
    None to train."""
    run_dir = Path(cfg.run_dir)
    path = run_dir / "summary.json"
    summary = _read(path)
    if summary is None or summary.get("ended") != "finished":
        return None
    if _run_id(run_dir) not in (None, cfg.run_id):  # another run's dir: its own business
        return None
    last = summary.get("iteration")
    more = cfg.rollout.num_rollout
    if cfg.ckpt.load and isinstance(last, int) and more is not None and more > last:
        return None  # trains on from the finished run's checkpoint
    if rerun_asked():
        print(
            f"[trainer] {RERUN}=1: training run {cfg.run_id} again in {run_dir}, over the files "
            "of its finished run",
            flush=True,
        )
        return None
    when = datetime.datetime.fromtimestamp(path.stat().st_mtime).astimezone()
    return (
        f"[trainer] run {cfg.run_id} finished at {when.isoformat(sep=' ', timespec='seconds')} "
        f"(iteration {last} of {summary.get('num_rollout')}; summary {path}): not training "
        f"it again. To run it again: {RERUN}=1, or another --run-id and --run-dir; to train "
        f"on from its checkpoint: --load with a --num-rollout above {last}"
    )
