"""One row per iteration on stdout, as Miles prints it, and every metric in metrics.jsonl.

    [trainer] iter 12/300 | loss=0.412 reward=0.61 kl=0.018 | rollout=18.4s train=22.1s
              sync=2.1s (total 42.6s) | grad_norm=0.93 lr=1.0e-06     (one line)

`--tensorboard-dir` and `--use-wandb` mirror the same metrics under train/, rollout/, perf/
and eval/ namespaces.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError

# The package each tracking flag needs (no extra of pyproject.toml ships them); preflight
# checks them before anything starts. torch.utils.tensorboard is torch's writer over tensorboard.
TRACKING_PACKAGES = {"--tensorboard-dir": "tensorboard", "--use-wandb": "wandb"}

NAMESPACES = {
    "train": ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss", "entropy_loss", "grad_norm", "lr", "tis",
              "tis_clipfrac", "train_rollout_logprob_abs_diff"),
    "perf": ("rollout_time", "train_time", "sync_time", "total_time", "completions_per_s"),
}  # fmt: skip


def namespaced(metrics: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if key.startswith("eval/"):
            out[key] = value
            continue
        space = next((ns for ns, keys in NAMESPACES.items() if key in keys), "rollout")
        out[f"{space}/{key}"] = value
    return out


def format_row(iteration: int, total: int, m: dict[str, float]) -> str:
    return (
        f"[trainer] iter {iteration}/{total} | loss={m.get('loss', 0):.3f} reward={m.get('raw_reward', 0):.2f} "
        f"kl={m.get('kl_loss', 0):.3f} | rollout={m.get('rollout_time', 0):.1f}s train={m.get('train_time', 0):.1f}s "
        f"sync={m.get('sync_time', 0):.1f}s (total {m.get('total_time', 0):.1f}s) | "
        f"grad_norm={m.get('grad_norm', 0):.2f} lr={m.get('lr', 0):.1e}"
    )


class MetricsLogger:
    def __init__(self, cfg: RunConfig, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = self._wandb = None
        if cfg.logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise MillstreamError(
                    f"--tensorboard-dir needs the tensorboard package ({err}): pip install tensorboard"
                ) from None
            self._tb = SummaryWriter(cfg.logging.tensorboard_dir)
        if cfg.logging.use_wandb:
            try:
                import wandb
            except ImportError:
                raise MillstreamError(
                    "--use-wandb needs the wandb package: pip install wandb"
                ) from None
            self._wandb = wandb.init(
                project=cfg.logging.wandb_project, group=cfg.logging.wandb_group, entity=cfg.logging.wandb_team,
                mode=cfg.logging.wandb_mode, name=cfg.run_id, config={"run_id": cfg.run_id},
            )  # fmt: skip

    def log(self, step: int, metrics: dict[str, Any], row: str | None = None) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        flat = {k: v for k, v in namespaced(metrics).items() if isinstance(v, int | float)}
        if self._tb is not None:
            for key, value in flat.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(flat, step=step)
        if row:
            print(row, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
