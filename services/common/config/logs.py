"""Logging flags: wandb and tensorboard mirrors of metrics.jsonl."""

from __future__ import annotations

from dataclasses import dataclass

from .schema import flag


@dataclass(frozen=True)
class LoggingConfig:
    use_wandb: bool = flag(False, "")
    wandb_project: str | None = flag(None, "")
    wandb_group: str | None = flag(None, "")
    wandb_team: str | None = flag(None, "")
    wandb_key: str | None = flag(None, "")
    wandb_mode: str | None = flag(None, "", choices=("online", "offline", "disabled"))
    tensorboard_dir: str | None = flag(None, "")
