"""Request bodies of the engine's native (SGLang) endpoints, as strict pydantic models.

Field names and defaults follow SGLang's `io_struct.py` (GenerateReqInput, AbortReq,
PauseGenerationReqInput, InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput,
UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput,
DestroyWeightsUpdateGroupReqInput) and `sampling_params.py`. Every model forbids unknown
fields, so a typo is a 400 naming the field instead of a silently ignored option. SGLang
options this engine cannot honour (penalties, constrained decoding, top logprobs) are
accepted only at their neutral value and otherwise rejected with a message saying so.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


FLATTENED_BUCKET = "flattened_bucket"


def _unsupported(name: str, value: Any, neutral: Any) -> None:
    if value is not None and value != neutral:
        raise ValueError(f"{name}={value!r} is not supported by the millstream CPU engine")


class SamplingParamsIn(Strict):
    max_new_tokens: int | None = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=1024)
    sampling_seed: int | None = None
    stream_interval: int | None = None
    # Accepted only at their neutral values (see module docstring).
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _neutral(self) -> SamplingParamsIn:
        _unsupported("min_new_tokens", self.min_new_tokens, 0)
        _unsupported("frequency_penalty", self.frequency_penalty, 0.0)
        _unsupported("presence_penalty", self.presence_penalty, 0.0)
        _unsupported("repetition_penalty", self.repetition_penalty, 1.0)
        for name in ("json_schema", "regex", "ebnf"):
            _unsupported(name, getattr(self, name), None)
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class GenerateReqIn(Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    # First prompt position of meta_info.input_token_logprobs (with return_logprob); None or
    # -1 (SGLang's default): the last prompt position only. Checked against each prompt's
    # length in generation.py (a 400 naming it).
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # Fields sglang-router adds when it re-serialises a request; accepted so a real
    # sglang-router can front this engine. `model` is informational; the rest must be off.
    model: str | None = None
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False
    no_logs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqIn:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        for name in ("return_hidden_states", "return_entropy", "return_bytes", "background"):
            _unsupported(name, getattr(self, name), False)
        tops = self.top_logprobs_num
        for value in tops if isinstance(tops, list) else [tops]:
            _unsupported("top_logprobs_num", value, 0)
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


class AbortReqIn(Strict):
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None
    finished_reason: dict[str, Any] | None = None


class PauseGenerationReqIn(Strict):
    mode: Literal["abort", "in_place", "retract"] = "abort"


class MemoryOccupationReqIn(Strict):
    """SGLang's Release/ResumeMemoryOccupationReqInput: which memory ("weights", "kv_cache",
    "cuda_graph"); None: all of it."""

    tags: list[str] | None = None


class ContinueGenerationReqIn(Strict):
    torch_empty_cache: bool = True


class InitWeightsUpdateGroupReqIn(Strict):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


class DestroyWeightsUpdateGroupReqIn(Strict):
    group_name: str = "weight_update_group"


class _UpdateCommon(Strict):
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False

    @field_validator("load_format")
    @classmethod
    def _format(cls, value: str | None) -> str | None:
        _unsupported("load_format", value, None)
        return value


class _FlattenedOrNot(_UpdateCommon):
    """An update that may come as SGLang's flattened_bucket: a bucket's tensors as one run of
    bytes, in order (one broadcast of them, or one shared handle to them)."""

    @field_validator("load_format")
    @classmethod
    def _format(cls, value: str | None) -> str | None:
        _unsupported("load_format", value, FLATTENED_BUCKET)
        return value


class UpdateWeightsFromDistributedReqIn(_FlattenedOrNot):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"

    @model_validator(mode="after")
    def _aligned(self) -> UpdateWeightsFromDistributedReqIn:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor (got "
                f"{len(self.names)}, {len(self.dtypes)}, {len(self.shapes)})"
            )
        return self


class UpdateWeightsFromTensorReqIn(_FlattenedOrNot):
    # Base64 of safetensors blobs (see weights.py), not SGLang's pickled tensors; with
    # load_format flattened_bucket, one entry (one tensor parallel rank) holding the JSON of a
    # shared bucket: its handle, CUDA IPC or shared memory, and each tensor's place in it
    # (common/tensor_share.py).
    serialized_named_tensors: list[str]
    disable_draft_model: bool | None = None

    @model_validator(mode="after")
    def _one_rank(self) -> UpdateWeightsFromTensorReqIn:
        n = len(self.serialized_named_tensors)
        if self.load_format == FLATTENED_BUCKET and n != 1:
            raise ValueError(
                f"serialized_named_tensors: one entry per tensor parallel rank, and this engine "
                f"has one (got {n})"
            )
        return self


class UpdateWeightFromDiskReqIn(_UpdateCommon):
    model_path: str
    is_async: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None


class FlushCacheReqIn(Strict):
    timeout_s: float | None = None
