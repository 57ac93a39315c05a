"""Optimizer flags (Miles' OPTIMIZER_ARGS), Megatron's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = flag("adam", "", choices=("adam", "sgd"))
    lr: float = flag(1e-6, "")
    min_lr: float = flag(0.0, "")
    lr_decay_style: str = flag("constant", "", choices=("constant", "linear", "cosine"))
    lr_warmup_iters: int = flag(0, "")
    lr_decay_iters: int | None = flag(None, "defaults to --num-rollout x --num-steps-per-rollout")
    weight_decay: float = flag(0.01, "")
    adam_beta1: float = flag(0.9, "")
    adam_beta2: float = flag(0.999, "")
    adam_eps: float = flag(1e-8, "")
    clip_grad: float = flag(1.0, "max grad norm (0 disables)")

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0 (got {self.lr})")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"--lr-warmup-iters must be >= 0 (got {self.lr_warmup_iters})")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be in [0, 1) (got {getattr(self, name)})"
                )
