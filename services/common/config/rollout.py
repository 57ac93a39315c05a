"""Rollout flags (Miles' ROLLOUT_ARGS): the data source, sampling, and the four batch knobs.

The four-knob invariant: rollout_batch_size x n_samples_per_prompt =
global_batch_size x num_steps_per_rollout. `resolve_batch_knobs` fills the one left out
(n_samples_per_prompt and num_steps_per_rollout default to 1 when fewer than three are given)
and rejects four that disagree, naming all four values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .schema import derived, flag

# Miles' own default rollout, as launch scripts often write it out: the rollout millstream's
# workers run anyway (one group at a time), so naming it means no plugin.
MILES_DEFAULT_ROLLOUT = {
    f"{pkg}.rollout.sglang_rollout.generate_rollout" for pkg in ("miles", "slime")
}


@dataclass(frozen=True)
class RolloutConfig:
    prompt_data: str | None = flag(None, "prompt JSONL file")
    input_key: str = flag("input", "JSONL key of the prompt (text or chat messages)")
    label_key: str | None = flag(None, "JSONL key of the label the reward compares against")
    metadata_key: str = flag("metadata", "JSONL key of per-row metadata")
    tool_key: str | None = flag(None, "JSONL key of tools for the chat template")
    apply_chat_template: bool = flag(False, "format prompts with the tokenizer's chat template")
    apply_chat_template_kwargs: dict[str, Any] = flag(
        {},
        "JSON object of keyword arguments for tokenizer.apply_chat_template, where the trainer "
        "formats prompts (Miles'), e.g. '{\"enable_thinking\": false}'",
    )
    chat_template_path: str | None = flag(
        None,
        "a Jinja chat template file that replaces the tokenizer's own where the trainer formats "
        "prompts (Miles'; for the chat API of SGLang servers, give --sglang-chat-template too)",
    )
    multimodal_keys: dict[str, Any] | None = flag(
        None,
        'Miles\' JSON map of media type to data key (\'{"image": "image_file"}\'); refused: '
        "millstream's prompts are text (or chat messages) only",
    )
    rollout_global_dataset: bool = flag(
        True,
        "Miles': no prompt data set. The trainer admits groups whose samples start empty (no "
        "prompt, no label): your --custom-generate-function-path or --rollout-function-path "
        "makes each prompt; a --data-source-path needs no such flag",
        option="--disable-rollout-global-dataset",
    )
    prompt_special_tokens: str = flag(
        "tokenizer",
        "tokenizer: a plain-text prompt gets the tokenizer's own special tokens (its BOS, if it "
        "adds one), as HF generate and TRL tokenize it; a chat-templated prompt gets none (the "
        "template writes them, as apply_chat_template(tokenize=True) does). miles: never add "
        "any (Miles' tokenizer(prompt, add_special_tokens=False))",
        choices=("tokenizer", "miles"),
    )
    skip_bad_lines: bool = flag(False, "count and skip malformed JSONL lines instead of failing")
    rollout_shuffle: bool = flag(False, "shuffle prompts, reshuffled each epoch with seed + epoch")
    rollout_seed: int = flag(42, "seed for shuffling and sampling")
    num_rollout: int | None = flag(None, "number of rollouts (training iterations)")
    num_epoch: int | None = flag(
        None, "epochs over the prompt data (sets --num-rollout when it is absent)"
    )
    rollout_batch_size: int | None = flag(None, "prompts per rollout")
    n_samples_per_prompt: int | None = flag(None, "responses per prompt (group size); default 1")
    global_batch_size: int | None = flag(None, "samples per optimizer step")
    num_steps_per_rollout: int | None = flag(None, "optimizer steps per rollout; default 1")
    over_sampling_batch_size: int | None = flag(
        None, "prompts admitted per refill under dynamic sampling"
    )
    rollout_max_prompt_len: int | None = flag(None, "skip (and count) longer prompts, in tokens")
    rollout_max_response_len: int = flag(1024, "max new tokens per response")
    rollout_max_context_len: int | None = flag(
        None,
        "Miles': cap on prompt + response tokens. Each request's max new tokens is clipped to "
        "what the prompt leaves, and --rollout-max-prompt-len (eval: --eval-max-prompt-len) "
        "defaults to one less, so every kept prompt generates at least one token",
    )
    rollout_temperature: float = flag(1.0, "")
    rollout_top_p: float = flag(1.0, "")
    rollout_top_k: int = flag(-1, "-1 disables top-k")
    rollout_min_p: float = flag(0.0, "")
    rollout_stop: list[str] | None = flag(None, "stop strings")
    rollout_stop_token_ids: list[int] | None = flag(None, "stop token ids")
    rollout_skip_special_tokens: bool = flag(False, "")
    rollout_max_concurrency: int = flag(64, "in-flight generation requests per rollout worker")
    rollout_function_path: str | None = flag(
        None,
        "pkg.mod.fn: your per-group async fn(group, cfg, client) -> SampleGroup (Miles' "
        "whole-batch generate_rollout(args, rollout_id, data_source) is refused)",
    )
    custom_generate_function_path: str | None = flag(
        None,
        "pkg.mod.fn: Miles' async generate(args, sample, sampling_params) -> Sample, called "
        "for each sample of a group; it reaches the router at args.sglang_router_ip/port",
    )
    eval_function_path: str | None = flag(
        None, "refused: Miles' whole-batch eval rollout; eval groups use the rollout function"
    )
    data_source_path: str | None = flag(
        None,
        "pkg.mod.Class: Miles' DataSource, Class(args) with get_samples(n) -> list[list[Sample]], "
        "save(rollout_id), load(rollout_id); replaces --prompt-data (needs --num-rollout)",
    )
    rollout_sample_filter_path: str | None = flag(
        None,
        "pkg.mod.fn(args, data: list[list[Sample]]) -> None: set sample.remove_sample to leave "
        "a sample out of the loss (Miles'); run per kept training group by the reward worker",
    )
    fully_async: bool = flag(
        False,
        "Miles' fully async rollout: workers keep generating while the trainer drains "
        "groups; that is `millstream train-async`, which `millstream train --fully-async` runs",
    )
    partial_rollout: bool = flag(
        False, "resume samples aborted by a weight sync from their partial tokens"
    )
    mask_offpolicy_in_partial_rollout: bool = flag(False, "mask the resumed prefix out of the loss")
    buffer_filter_path: str | None = flag(
        None,
        "pkg.mod.fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]: the order "
        "partial groups resume in",
    )
    dynamic_sampling_filter_path: str | None = flag(
        None,
        "pkg.mod.fn(args, samples, **kwargs) -> DynamicFilterOutput; built-ins: "
        "check_reward_nonzero_std, check_no_aborted",
    )
    custom_config_path: str | None = flag(
        None,
        "Miles': a YAML file (or base64:<YAML>) of settings, read once at start. A key that names "
        "a flag sets it, over the command line, as Miles' setattr does; any other key (a "
        "plugin's own: tis_level, use_rs, ...) reaches plugins as args.<key>",
    )
    # The --custom-config-path keys that name no flag, for plugins' `args` (compat/miles).
    custom_config: dict[str, Any] = derived({}, "the --custom-config-path keys that are no flag")

    @property
    def reads_prompt_data(self) -> bool:
        """The trainer's prompts are --prompt-data's rows: Miles' default data source, with its
        data set (no --disable-rollout-global-dataset)."""
        return self.rollout_global_dataset and is_default_source(self.data_source_path)

    @property
    def logprob_temperature(self) -> float:
        """The temperature logprobs are taken at, as the engine reports them (1 for greedy)."""
        return self.rollout_temperature if self.rollout_temperature > 1e-6 else 1.0

    def __post_init__(self) -> None:
        for name in ("rollout_function_path", "eval_function_path"):
            if getattr(self, name) in MILES_DEFAULT_ROLLOUT:
                object.__setattr__(self, name, None)
        for name in (
            "rollout_batch_size",
            "n_samples_per_prompt",
            "global_batch_size",
            "num_steps_per_rollout",
            "num_rollout",
            "num_epoch",
            "over_sampling_batch_size",
            "rollout_max_prompt_len",
            "rollout_max_context_len",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 (got {value})")
        context = self.rollout_max_context_len
        if context is not None:
            if self.rollout_max_prompt_len is None:
                object.__setattr__(self, "rollout_max_prompt_len", context - 1)
            if not 0 < self.rollout_max_prompt_len < context:
                raise ConfigError(
                    f"--rollout-max-prompt-len ({self.rollout_max_prompt_len}) must be below "
                    f"--rollout-max-context-len ({context}), so that a kept prompt leaves room "
                    "for at least one generated token"
                )
        if self.rollout_max_response_len <= 0:
            raise ConfigError(
                f"--rollout-max-response-len must be > 0 (got {self.rollout_max_response_len})"
            )
        if self.rollout_temperature < 0:
            raise ConfigError(
                f"--rollout-temperature must be >= 0 (got {self.rollout_temperature})"
            )
        if not 0 < self.rollout_top_p <= 1:
            raise ConfigError(f"--rollout-top-p must be in (0, 1] (got {self.rollout_top_p})")
        if self.rollout_max_concurrency <= 0:
            raise ConfigError(
                f"--rollout-max-concurrency must be > 0 (got {self.rollout_max_concurrency})"
            )
        if (
            self.over_sampling_batch_size is not None
            and self.rollout_batch_size is not None
            and self.over_sampling_batch_size < self.rollout_batch_size
        ):
            raise ConfigError(
                f"--over-sampling-batch-size ({self.over_sampling_batch_size}) must be >= "
                f"--rollout-batch-size ({self.rollout_batch_size})"
            )


def resolve_batch_knobs(
    rollout_batch_size: int | None,
    n_samples_per_prompt: int | None,
    global_batch_size: int | None,
    num_steps_per_rollout: int | None,
) -> tuple[int, int, int, int]:
    """Return the four knobs with the missing one filled in; ConfigError when impossible."""
    rbs, n, gbs, steps = (
        rollout_batch_size,
        n_samples_per_prompt,
        global_batch_size,
        num_steps_per_rollout,
    )

    def show() -> str:
        return (
            f"--rollout-batch-size={rbs} x --n-samples-per-prompt={n} must equal "
            f"--global-batch-size={gbs} x --num-steps-per-rollout={steps}"
        )

    if [rbs, n, gbs, steps].count(None) >= 2:
        if n is None:
            n = 1
        if [rbs, n, gbs, steps].count(None) >= 2 and steps is None:
            steps = 1
    missing = [v is None for v in (rbs, n, gbs, steps)]
    if sum(missing) > 1:
        raise ConfigError("give at least --rollout-batch-size or --global-batch-size: " + show())
    if rbs is None:
        if (gbs * steps) % n:
            raise ConfigError(
                f"cannot fill --rollout-batch-size: {gbs * steps} is not divisible by {n}; "
                + show()
            )
        rbs = gbs * steps // n
    elif n is None:
        if (gbs * steps) % rbs:
            raise ConfigError(
                f"cannot fill --n-samples-per-prompt: {gbs * steps} is not divisible by {rbs}; "
                + show()
            )
        n = gbs * steps // rbs
    elif gbs is None:
        if (rbs * n) % steps:
            raise ConfigError(
                f"cannot fill --global-batch-size: {rbs * n} is not divisible by {steps}; " + show()
            )
        gbs = rbs * n // steps
    elif steps is None:
        if (rbs * n) % gbs:
            raise ConfigError(
                f"cannot fill --num-steps-per-rollout: {rbs * n} is not divisible by {gbs}; "
                + show()
            )
        steps = rbs * n // gbs
    if rbs * n != gbs * steps:
        raise ConfigError(
            "the four batch knobs disagree: " + show() + f" ({rbs * n} != {gbs * steps})"
        )
    return rbs, n, gbs, steps


# Miles' default data source, by any of its paths: the trainer's JSONL source
# (trainer/data.py PromptDataSource) does its job.
MILES_DEFAULT_SOURCES = ("RolloutDataSourceWithBuffer", "RolloutDataSource")
_DEFAULT_PREFIXES = ("miles.rollout.data_source.", "slime.rollout.data_source.")


def is_default_source(path: str | None) -> bool:
    """No --data-source-path, or Miles' own default named by its module path."""
    return not path or (
        path.startswith(_DEFAULT_PREFIXES) and path.rsplit(".", 1)[-1] in MILES_DEFAULT_SOURCES
    )
