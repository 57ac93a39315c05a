"""Eval flags (Miles' EVAL_ARGS). Sampling overrides left unset inherit the rollout values."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag


@dataclass(frozen=True)
class EvalConfig:
    eval_interval: int | None = flag(None, "evaluate every N rollouts")
    eval_prompt_data: list[str] | None = flag(None, "pairs: NAME PATH [NAME PATH ...]")
    eval_input_key: str | None = flag(None, "defaults to --input-key")
    eval_label_key: str | None = flag(None, "defaults to --label-key")
    eval_metadata_key: str | None = flag(None, "defaults to --metadata-key")
    n_samples_per_eval_prompt: int = flag(1, "")
    eval_temperature: float | None = flag(None, "defaults to --rollout-temperature")
    eval_top_p: float | None = flag(None, "defaults to --rollout-top-p")
    eval_top_k: int | None = flag(None, "defaults to --rollout-top-k")
    eval_max_response_len: int | None = flag(None, "defaults to --rollout-max-response-len")
    eval_max_prompt_len: int | None = flag(
        None,
        "skip (and count) longer eval prompts, in tokens (default: none; with "
        "--rollout-max-context-len, one less than it)",
    )
    eval_min_new_tokens: int | None = flag(
        None,
        "Miles': SGLang's min_new_tokens for eval requests (no stop before that many tokens); "
        "millstream's own engine does not implement it, so it needs SGLang's servers",
    )
    skip_eval_before_train: bool = flag(False, "")

    def __post_init__(self) -> None:
        if self.eval_prompt_data is not None and len(self.eval_prompt_data) % 2:
            raise ConfigError(
                f"--eval-prompt-data takes NAME PATH pairs (got {len(self.eval_prompt_data)} values: "
                f"{' '.join(self.eval_prompt_data)})"
            )
        if self.eval_interval is not None and self.eval_interval <= 0:
            raise ConfigError(f"--eval-interval must be > 0 (got {self.eval_interval})")
        if self.eval_min_new_tokens is not None and self.eval_min_new_tokens < 0:
            raise ConfigError(
                f"--eval-min-new-tokens must be >= 0 (got {self.eval_min_new_tokens})"
            )

    def datasets(self) -> dict[str, str]:
        data = self.eval_prompt_data or []
        return dict(zip(data[::2], data[1::2], strict=True))
