"""Algorithm flags (Miles' GRPO_ARGS): estimator, clipping, KL, entropy, TIS, critic, OPD."""

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
# Estimators whose returns take the reward-side KL (--use-kl-in-reward / --kl-coef).
KL_IN_REWARD_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
# Miles' two built-in TIS functions, by name (in Miles' own modules, or bare): --tis-mode's.
MILES_TIS_FUNCTIONS = {"vanilla_tis_function": "tis", "icepop_function": "icepop"}
_MILES_PACKAGES = ("miles.", "slime.")


def builtin_tis_mode(path: str | None) -> str | None:
    """The --tis-mode that --custom-tis-function-path `path` names (one of Miles' built-ins),
    else None: a function of the user's, which the trainer's loss calls."""
    if not path:
        return None
    module, _, name = path.rpartition(":" if ":" in path else ".")
    if module and not module.startswith(_MILES_PACKAGES):
        return None
    return MILES_TIS_FUNCTIONS.get(name)


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
    tis_mode: str = flag(
        "tis", "tis: clamp the weight into the range; icepop: zero tokens outside it",
        choices=("tis", "icepop"), miles=False,
    )  # fmt: skip
    custom_tis_function_path: str | None = flag(
        None,
        "with --use-tis: pkg.mod.fn, Miles' TIS/RS function fn(args, *, pg_loss, "
        "train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths, "
        "parallel_state, max_seq_lens) -> (pg_loss, loss_masks, metrics), applied in the "
        "trainer's loss (trainer/algorithms/tis.py); Miles' vanilla_tis_function and "
        "icepop_function are the built-in --tis-mode tis and icepop",
    )
    tis_clip_low: float = flag(0.0, "TIS range, low end")
    tis_clip: float = flag(2.0, "TIS range, high end", aliases=("--tis-clip-high",))
    use_rollout_logprobs: bool = flag(
        False,
        "Miles': the engines' logprobs of the samples are the old policy of the PPO ratio, "
        "instead of the trainer's recomputed ones (TIS and the mismatch metrics still compare "
        "the trainer's with the engines')",
    )
    keep_old_actor: bool = flag(
        False, "Miles' copy of the rollout's weights to recompute old logprobs; refused"
    )
    calculate_per_token_loss: bool = flag(
        False, "token-mean over the global batch instead of per-sample mean"
    )
    normalize_advantages: bool = flag(False, "whiten advantages over the batch")
    use_opd: bool = flag(False, "add the on-policy distillation term to any estimator")
    opd_kl_coef: float = flag(
        1.0, "on-policy distillation: advantage -= coef * (student - teacher)"
    )
    opd_teacher_url: str | None = flag(None, "on-policy distillation teacher engine (SGLang API)")
    opd_teacher_load: str | None = flag(None, "on-policy distillation teacher model dir")
    opd_type: str | None = flag(
        None,
        "accepted, and checked against the teacher flag given: megatron (the trainer runs "
        "the teacher, --opd-teacher-load) or sglang (an engine, --opd-teacher-url)",
        choices=("sglang", "megatron"),
    )
    critic_load: str | None = flag(
        None, "PPO critic: a model dir to start from (default: the actor's), or a critic checkpoint"
    )
    critic_lr: float | None = flag(None, "PPO critic learning rate (default: --lr)")
    num_critic_only_steps: int = flag(0, "PPO: train only the critic for the first N rollouts")

    def __post_init__(self) -> None:
        if self.eps_clip < 0:
            raise ConfigError(f"--eps-clip must be >= 0 (got {self.eps_clip})")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ConfigError(f"--eps-clip-c must be > 1 (got {self.eps_clip_c})")
        if self.tis_clip_low > self.tis_clip:
            raise ConfigError(
                f"--tis-clip-low ({self.tis_clip_low}) must be <= --tis-clip ({self.tis_clip})"
            )
        if self.kl_loss_coef and not self.use_kl_loss:
            raise ConfigError(f"--kl-loss-coef {self.kl_loss_coef} needs --use-kl-loss")
        if self.kl_coef and not self.use_kl_in_reward:
            raise ConfigError(f"--kl-coef {self.kl_coef} needs --use-kl-in-reward")
        if self.use_kl_in_reward and self.advantage_estimator not in KL_IN_REWARD_ESTIMATORS:
            raise ConfigError(
                f"--use-kl-in-reward applies to {', '.join(KL_IN_REWARD_ESTIMATORS)}, "
                f"not --advantage-estimator {self.advantage_estimator}"
            )
        if not 0 <= self.gamma <= 1 or not 0 <= self.lambd <= 1:
            raise ConfigError(
                f"--gamma and --lambd must be in [0, 1] (got {self.gamma}, {self.lambd})"
            )
        if self.value_clip <= 0:
            raise ConfigError(f"--value-clip must be > 0 (got {self.value_clip})")
        if mode := builtin_tis_mode(self.custom_tis_function_path):
            object.__setattr__(self, "tis_mode", mode)
        if self.distills and not (self.opd_teacher_url or self.opd_teacher_load):
            raise ConfigError(
                "on-policy distillation needs a teacher: --opd-teacher-url (an engine) "
                "or --opd-teacher-load (a model dir the trainer loads)"
            )
        if self.opd_teacher_url and self.opd_teacher_load:
            raise ConfigError("give one teacher: --opd-teacher-url or --opd-teacher-load, not both")
        if self.opd_type == "megatron" and self.opd_teacher_url:
            raise ConfigError(
                "--opd-type megatron runs the teacher in the trainer: give --opd-teacher-load "
                "(a model dir), not --opd-teacher-url"
            )
        if self.opd_type == "sglang" and self.opd_teacher_load:
            raise ConfigError(
                "--opd-type sglang takes the teacher's logprobs from an engine: give "
                "--opd-teacher-url, not --opd-teacher-load (as Miles refuses it)"
            )

    @property
    def custom_tis_function(self) -> str | None:
        """--custom-tis-function-path when it names the user's function (not a built-in)."""
        path = self.custom_tis_function_path
        return None if builtin_tis_mode(path) else path

    @property
    def distills(self) -> bool:
        """The on-policy distillation term is on (the estimator itself, or --use-opd)."""
        return self.use_opd or self.advantage_estimator == "on_policy_distillation"

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "ppo"
