"""Miles' `miles.utils.types`: `Sample`, `RewardSpec`, `AdapterRef` and the multimodal types.

`Sample` has every field and method of Miles' (miles/utils/types.py), in Miles' order, with
Miles' meaning: `tokens` is prompt + response token ids, `response_length` the response's
share of them, `loss_mask`, `rollout_log_probs`, `teacher_log_probs` and `opd_reverse_kl` one
entry per response token, `status` a `Sample.Status`. Three fields at the end are
millstream's, carried by the wire message: `group_id`, `finish_reason` (the engine's finish
type) and `failure_reason`. How the wire message maps to it: the package docstring.

The numpy fields (`rollout_routed_experts`, `rollout_indexer_topk`) are annotated only, so
importing this module imports no numpy (nor torch: Miles' `ParamInfo` and `RolloutBatch`, which
describe its weight sync, are not here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy

__all__ = ["AdapterRef", "MultimodalType", "MultimodalTypes", "RewardSpec", "Sample"]


@dataclass(frozen=True)
class AdapterRef:
    """The LoRA adapter a sample is bound to (Miles' multi-LoRA; no adapter here is None)."""

    name: str
    slot: int


@dataclass(frozen=True)
class RewardSpec:
    """How one sample is scored, when it differs from the run's --rm-type/--custom-rm-path."""

    rm_type: str | None = None
    custom_rm_path: str | None = None


@dataclass
class Sample:
    """One sample, with the fields and meaning of Miles' `Sample` (see the module docstring)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None  # counts one rollout once; None: `index` does
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None  # raw images, videos, audios
    multimodal_train_inputs: dict[str, Any] | None = None  # the processor's, e.g. pixel_values
    response: str = ""
    response_length: int = 0
    label: Any = None  # the data row's label: text, or the JSON value it holds
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: numpy.ndarray | None = None  # (tokens - 1, layers, topk) int32
    rollout_indexer_topk: numpy.ndarray | None = None  # (tokens - 1, indexer layers, topk)
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        # a recoverable failure (a tool call, an external API): may hold partial output
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None  # this sample's own custom generate function
    train_metadata: dict | None = None
    adapter: AdapterRef | None = None
    reward_spec: RewardSpec | None = None
    routing_key: str | None = None  # sent to the router as X-SMG-Routing-Key
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        """Speculative decoding counts, summed over the sample's generate calls."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            drafted = self.spec_draft_token_num
            return self.spec_accept_token_num / drafted if drafted > 0 else 0.0

        @property
        def spec_accept_length(self) -> float:
            verified = self.spec_verify_ct
            return self.completion_token_num / verified if verified > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict) -> Sample.SpecInfo:
            names = [f.name for f in dataclasses.fields(Sample.SpecInfo)]
            return Sample.SpecInfo(**{name: data.get(name, 0) for name in names})

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens the engine found in its prefix cache, summed over generate calls."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            total = self.total_prompt_tokens
            return self.cached_tokens / total if total > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict) -> Sample.PrefixCacheInfo:
            return Sample.PrefixCacheInfo(
                cached_tokens=data.get("cached_tokens", 0),
                total_prompt_tokens=data.get("total_prompt_tokens", 0),
            )

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)
    # millstream's, from the wire message
    group_id: str = ""
    finish_reason: str = ""
    failure_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Every attribute (an attribute set outside the fields too), `status` as its value
        and the two info records as dicts, as Miles' to_dict."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        """The inverse of to_dict; a key that is no field becomes an attribute (Miles')."""
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", Sample.Status.PENDING.value))
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info") or {})
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(
            data.get("prefix_cache_info") or {}
        )
        if isinstance(data.get("adapter"), dict):
            data["adapter"] = AdapterRef(**data["adapter"])
        if isinstance(data.get("reward_spec"), dict):
            data["reward_spec"] = RewardSpec(**data["reward_spec"])
        names = {f.name for f in dataclasses.fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args: Any) -> float:
        """The reward, or its `args.reward_key` entry when the reward is a dict."""
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.response_length]

    @property
    def response_tokens(self) -> list[int]:
        return (
            self.tokens[len(self.tokens) - self.response_length :] if self.response_length else []
        )

    def validate(self) -> None:
        """AssertionError naming the field whose length disagrees with the response (Miles')."""
        n = self.response_length
        assert n >= 0, f"response_length must be >= 0, got {n}"
        assert len(self.tokens) >= n, (
            f"tokens length ({len(self.tokens)}) must be >= response_length ({n})"
        )
        for name in ("loss_mask", "rollout_log_probs", "teacher_log_probs", "opd_reverse_kl"):
            value = getattr(self, name)
            assert value is None or len(value) == n, (
                f"{name} length ({len(value)}) != response_length ({n})"
            )
        expect = len(self.tokens) - 1  # one row per position that predicts a token
        if self.rollout_routed_experts is not None:
            media = self.multimodal_train_inputs or {}
            extra = sum(  # a media item expands to its patches in the engine
                int(c) - 1
                for key in ("mm_vision_num_patches", "mm_audio_num_tokens")
                for c in list(media.get(key) or [])
            )
            actual = len(self.rollout_routed_experts)
            assert actual in (expect, expect + extra), (
                f"rollout_routed_experts length ({actual}) != len(tokens) - 1 ({expect})"
                f" or media-expanded ({expect + extra})"
            )
        if self.rollout_indexer_topk is not None:
            actual = len(self.rollout_indexer_topk)
            assert actual == expect, (
                f"rollout_indexer_topk length ({actual}) != len(tokens) - 1 ({expect})"
            )

    def strip_last_output_tokens(self, n: int, tokenizer: Any) -> None:
        """Drop the last n response tokens and everything kept per token for them; the
        response text is decoded again from what is left."""
        if n <= 0:
            return
        assert n <= self.response_length, (
            f"cannot strip {n} tokens: only {self.response_length} output tokens available"
        )
        self.tokens = self.tokens[:-n]
        self.response_length -= n
        for name in (
            "rollout_log_probs",
            "teacher_log_probs",
            "opd_reverse_kl",
            "loss_mask",
            "rollout_routed_experts",
            "rollout_indexer_topk",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[:-n])
        if self.metadata and "opd_student_top_logprobs" in self.metadata:
            top = self.metadata["opd_student_top_logprobs"]
            self.metadata["opd_student_top_logprobs"] = top[:-n]
        self.response = (
            tokenizer.decode(self.tokens[-self.response_length :]) if self.response_length else ""
        )

    def reset_for_retry(self) -> None:
        """Back to the prompt, to sample it again: the identity and prompt fields stay (group
        and sample index, prompt, label, multimodal inputs, metadata, generate function path,
        routing key); the generated ones go back to their defaults, status to ABORTED."""
        self.tokens = []
        self.multimodal_train_inputs = None
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.loss_mask = None
        self.weight_versions = []
        self.rollout_log_probs = None
        self.rollout_routed_experts = None
        self.rollout_indexer_topk = None
        self.status = Sample.Status.ABORTED
        self.non_generation_time = 0.0
        self.spec_info = Sample.SpecInfo()
        self.prefix_cache_info = Sample.PrefixCacheInfo()
        self.remove_sample = False
        self.train_metadata = None

    @property
    def oldest_weight_version(self) -> int | None:
        """The lowest numeric weight version any generate call of this sample saw."""
        numeric = [int(v) for v in self.weight_versions if str(v).isdigit()]
        return min(numeric) if numeric else None

    def update_from_meta_info(self, args: Any, meta_info: dict) -> None:
        """Take what an engine's answer says about this generate call (SGLang's meta_info):
        speculative and prefix cache counts, the weight version, and the status from the
        finish reason (stop: COMPLETED, length: TRUNCATED, abort: ABORTED)."""
        if getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta_info=meta_info)
        self.prefix_cache_info.add(meta_info=meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        finish = (meta_info.get("finish_reason") or {}).get("type")
        if finish:
            self.finish_reason = finish
        status = _STATUS_OF_FINISH.get(finish)
        if status is not None:
            self.status = status


_STATUS_OF_FINISH = {
    "stop": Sample.Status.COMPLETED,
    "length": Sample.Status.TRUNCATED,
    "abort": Sample.Status.ABORTED,
}


@dataclass
class MultimodalType:
    name: str  # the content type in a message: "image"
    placeholder: str  # its placeholder in prompt text: "<image>"


class MultimodalTypes:
    IMAGE = MultimodalType(name="image", placeholder="<image>")
    VIDEO = MultimodalType(name="video", placeholder="<video>")
    AUDIO = MultimodalType(name="audio", placeholder="<audio>")

    @classmethod
    def all(cls) -> list[MultimodalType]:
        return [cls.IMAGE, cls.VIDEO, cls.AUDIO]

    @classmethod
    def get(cls, name: str) -> MultimodalType | None:
        return next((m for m in cls.all() if m.name == name), None)
