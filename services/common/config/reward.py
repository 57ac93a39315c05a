"""Reward flags: built-in --rm-type, custom functions, remote RM, timeouts and executors."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag


@dataclass(frozen=True)
class RewardConfig:
    rm_type: str | None = flag(
        None,
        "math, deepscaler, dapo, f1 (Miles' values, see --rm-compat), exact (the response as "
        "produced, special tokens kept, stop token dropped; cut by length: 0), remote_rm; "
        "boxed_ prefix allowed",
    )
    rm_compat: str = flag(
        "miles",
        "miles: the built-ins give Miles' values (its rm_hub code: math needs a \\boxed{}, "
        "deepscaler a </think>, dapo an 'Answer:' line and an integer label); millstream: "
        "millstream's own lenient reading (math falls back to the last number, deepscaler "
        "reads a response without </think>, dapo falls back to \\boxed{}; equivalence by "
        "math-verify). exact and f1 are the same in both",
        choices=("miles", "millstream"),
    )
    custom_rm_path: str | None = flag(
        None, "pkg.mod.fn(args, sample) -> float: your reward (sync or async)"
    )
    group_rm: bool = flag(
        False, "the custom reward scores a whole group at once: fn(args, samples) -> list"
    )
    reward_key: str | None = flag(None, "take this key when a reward returns a dict")
    rm_url: str | None = flag(None, "remote reward model URL (rm_type remote_rm)")
    reward_timeout: float = flag(30.0, "seconds per sample")
    reward_retries: int = flag(1, "retries of a reward that raised or timed out")
    reward_executor: str = flag("inline", "", choices=("inline", "celery"))
    reward_max_concurrency: int = flag(64, "groups scored at once per reward worker")

    def __post_init__(self) -> None:
        if self.rm_type == "remote_rm" and not self.rm_url:
            raise ConfigError("--rm-type remote_rm needs --rm-url")
        if self.reward_timeout <= 0:
            raise ConfigError(f"--reward-timeout must be > 0 (got {self.reward_timeout})")
        if self.reward_retries < 0:
            raise ConfigError(f"--reward-retries must be >= 0 (got {self.reward_retries})")
