"""Algorithm flags (Miles' GRPO_ARGS): estimator, clipping, KL, entropy, TIS."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag

ESTIMATORS = (
    "grpo",
    "gspo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
    "on_policy_distillation",
)


@dataclass(frozen=True)
class AlgoConfig:
    advantage_estimator: str = flag("grpo", "", choices=ESTIMATORS)
    disable_grpo_std_normalization: bool = flag(False, "GRPO: subtract the group mean only")
    eps_clip: float = flag(0.2, "PPO ratio clip (low side)")
    eps_clip_high: float | None = flag(None, "PPO ratio clip, high side (defaults to --eps-clip)")
    eps_clip_c: float | None = flag(None, "dual-clip constant (> 1)")
    use_kl_loss: bool = flag(False, "KL to the reference model in the loss")
    kl_loss_coef: float = flag(0.0, "0 keeps KL as a logged signal only")
    kl_loss_type: str = flag("k1", "", choices=("k1", "k2", "k3", "low_var_kl"))
    use_kl_in_reward: bool = flag(False, "REINFORCE++: per-token -kl_coef*kl in the reward")
    kl_coef: float = flag(0.0, "reward-side KL coefficient")
    entropy_coef: float = flag(0.0, "entropy bonus coefficient")
    gamma: float = flag(1.0, "discount")
    lambd: float = flag(1.0, "GAE lambda")
    value_clip: float = flag(0.2, "PPO critic value clip")
    use_tis: bool = flag(False, "truncated importance sampling on train/rollout logprob mismatch")
    tis_clip_low: float = flag(0.0, "")
    tis_clip_high: float = flag(2.0, "")
    calculate_per_token_loss: bool = flag(
        False, "token-mean over the global batch instead of per-sample mean"
    )
    normalize_advantages: bool = flag(False, "whiten advantages over the batch")
    opd_kl_coef: float = flag(
        1.0, "on-policy distillation: advantage -= coef * (student - teacher)"
    )
    opd_teacher_url: str | None = flag(None, "on-policy distillation teacher engine (SGLang API)")
    opd_teacher_load: str | None = flag(None, "on-policy distillation teacher model dir")

    def __post_init__(self) -> None:
        if self.eps_clip < 0:
            raise ConfigError(f"--eps-clip must be >= 0 (got {self.eps_clip})")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ConfigError(f"--eps-clip-c must be > 1 (got {self.eps_clip_c})")
        if self.tis_clip_low > self.tis_clip_high:
            raise ConfigError(
                f"--tis-clip-low ({self.tis_clip_low}) must be <= --tis-clip-high ({self.tis_clip_high})"
            )
        if self.kl_loss_coef and not self.use_kl_loss:
            raise ConfigError(f"--kl-loss-coef {self.kl_loss_coef} needs --use-kl-loss")
