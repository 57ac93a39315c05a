"""Logging flags: wandb and tensorboard mirrors of metrics.jsonl, and Miles' custom log functions.

Miles' names and meanings (radixark/miles miles/utils/arguments.py add_wandb_arguments,
add_tensorboard_arguments, and the two --custom-*-log-function-path flags of the rollout
arguments); `--tensorboard-dir` is Megatron's and Miles' FSDP backend's spelling of a fixed
directory. What the trainer does with them:
trainer/observe/metrics.py and trainer/observe/log_hooks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag


@dataclass(frozen=True)
class LoggingConfig:
    use_wandb: bool = flag(False, "mirror the metrics to Weights & Biases")
    wandb_project: str | None = flag(None, "W&B project")
    wandb_group: str | None = flag(None, "W&B run group")
    wandb_team: str | None = flag(None, "W&B entity (team or user)")
    wandb_key: str | None = flag(
        None, "W&B API key for online mode (default: WANDB_API_KEY); never written out"
    )
    wandb_host: str | None = flag(None, "W&B server URL for online mode (default: wandb's)")
    wandb_mode: str | None = flag(
        None,
        "online, offline (writes under --wandb-dir, no network) or disabled; default WANDB_MODE",
        choices=("online", "offline", "disabled"),
    )
    wandb_dir: str | None = flag(None, "where wandb writes its files (default: the run dir)")
    use_tensorboard: bool = flag(
        False,
        "mirror the metrics to tensorboard in --tensorboard-dir, else TENSORBOARD_DIR, else "
        "tensorboard_log/TB_PROJECT_NAME/TB_EXPERIMENT_NAME",
    )
    tb_project_name: str | None = flag(None, "with --use-tensorboard: tensorboard_log/<this>/...")
    tb_experiment_name: str | None = flag(
        None, "with --use-tensorboard: .../<this> (default: the start time, %%Y%%m%%d_%%H%%M%%S)"
    )
    tensorboard_dir: str | None = flag(None, "mirror the metrics to tensorboard in this directory")
    log_passrate: bool = flag(
        False,
        "Miles': pass@k of each rollout's groups (k = 1, 2, 4, ... up to the group size; a "
        "sample passes with reward 1) as passrate/pass@k, and of each eval set as "
        "eval/<set>-pass@k",
    )
    custom_rollout_log_function_path: str | None = flag(
        None,
        "pkg.mod.fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool, "
        "called each iteration; True skips the default rollout/ logging",
    )
    custom_eval_rollout_log_function_path: str | None = flag(
        None,
        "pkg.mod.fn(rollout_id, args, data, extra_metrics) -> bool, called after each eval; "
        "True skips the default eval/ logging",
    )

    def __post_init__(self) -> None:
        if self.wandb_key is not None and not self.wandb_key.strip():
            raise ConfigError("--wandb-key is empty")
