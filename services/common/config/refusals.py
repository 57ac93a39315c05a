"""Every flag `millstream train` accepts is read, refused, or passed through (issue 14).

The rule: a Miles flag does here what it does in Miles, or the run exits 2 before anything
starts, naming the flag and why. Each field of each RunConfig group is one of:

- read: a component outside the config package reads it (`cfg.rollout.rollout_batch_size`).
  Most flags are. tests/unit/repo/test_flags_consumed.py proves it for each by finding the
  attribute in services/ (the config package and preflight left out: checking a flag is not
  using it).
- derived (DERIVED): the config folds it into another value of its group, which is read
  (--global-batch-size fills --num-steps-per-rollout).
- refused (REFUSED): what it asks for is not built here. Any value but the default exits 2
  (`check`, from the flags alone: checks.py, preflight's first step). Miles scripts set many of these
  to the value that asks for nothing special (--tensor-model-parallel-size 1, dropout 0.0):
  those pass.
- matched (MATCHED): Megatron's description of the model (MODEL_ARGS) that the Hugging Face
  checkpoint's config.json already fixes. The torch backend builds the model from the
  checkpoint, so a value given must equal the checkpoint's (`check_model`, in preflight's
  file step), as Miles' hf_validate_args holds them for its Megatron backend. A key the
  config.json does not have is not checked.
- accepted (ACCEPTED): nothing to do, and --help says so: what the flag asks for is already
  so here (fp32 gradients), or the checkpoint's modeling code decides it and config.json has
  no key to check it against (--qk-layernorm).
- passed through (PASSED_THROUGH): settings of the engines `millstream train` starts, handed
  on to them. Every --sglang-X flag millstream does not name itself goes to SGLang's
  launch_server as --X (cfg.sglang.sglang_server_args), or, where SGLang is not installed, to
  millstream's engine where it has the setting, refused by name where it has not
  (launch/engines.py).

A new flag belongs to one of these; the test fails for one that nothing reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

from millstream.common.config import GROUPS, ConfigError, RunConfig

# The group each field is in, and its default (no refused or matched field has a list default).
_GROUP_OF = {f.name: group for group, cls, _ in GROUPS for f in dataclasses.fields(cls)}
_DEFAULT = {f.name: f.default for _, cls, _ in GROUPS for f in dataclasses.fields(cls)}

# field -> the value of its group the config folds it into (a property or method counts).
DERIVED: dict[str, str] = {
    "global_batch_size": "num_steps_per_rollout",  # resolve_batch_knobs
    "eval_prompt_data": "datasets",  # NAME PATH pairs -> {name: path}
    "custom_tis_function_path": "tis_mode",  # Miles' icepop_function -> icepop (else: read)
    "custom_config_path": "custom_config",  # the file's keys that are no flag (custom.py)
    "use_opd": "distills",  # the distillation term is on
    "redis_password_file": "redis_password",  # the file's contents
}

_NO_MEGATRON = (
    "needs model parallelism that is not built yet: --train-backend megatron is tensor, "
    "pipeline, context and data parallel (--tensor-model-parallel-size, "
    "--pipeline-model-parallel-size, --context-parallel-size, more ranks under torchrun), the "
    "torch backend data parallel, and --train-backend fsdp shards the model across the ranks"
)
_NO_RECOMPUTE = (
    "is Megatron's activation recomputation: give --train-backend megatron too (the torch "
    "backends keep activations: save memory there with a smaller --micro-batch-size or "
    "--max-tokens-per-gpu)"
)
_NO_DROPOUT = (
    "is Megatron's dropout, which the torch backend does not apply (the HF model's own "
    "config.json sets its dropout): drop it, or give 0"
)

# field -> why a value other than the default cannot be honoured. In this order: the first
# one a run has is the error, the others are named after it.
REFUSED: dict[str, str] = {
    "expert_model_parallel_size": _NO_MEGATRON,
    "expert_tensor_parallel_size": _NO_MEGATRON,
    "attention_dropout": _NO_DROPOUT,
    "hidden_dropout": _NO_DROPOUT,
    "attention_backend": (
        "picks Megatron's attention kernel; the torch backend runs the HF model's own "
        "attention and has no such choice: drop it"
    ),
    "eval_function_path": (
        "is Miles' whole-batch eval rollout, generate_rollout(args, rollout_id, data_source, "
        "evaluation=True); here the trainer admits eval groups (--eval-prompt-data) like "
        "training ones and the rollout worker serves each with the rollout function: write a "
        "per-group --rollout-function-path fn(group, cfg, client) -> SampleGroup (it sees "
        "group.is_eval), or drop it"
    ),
    "update_weight_mode": (
        "delta sends only what changed since the last sync, through files (Miles' disk "
        "delta); millstream sends the full weights every sync: drop it, or give full"
    ),
    "keep_old_actor": (
        "keeps one copy of the weights the engines generated with, one version back, to "
        "recompute the old logprobs (Miles' one-step-off async); here a batch can mix samples "
        "of several versions (--max-staleness), so no single copy is the old policy: use "
        "--use-rollout-logprobs (the engines' own logprobs as the old policy) or --use-tis"
    ),
    "multimodal_keys": (
        "maps media (images, video) to data keys for a multimodal model; millstream's prompts, "
        "engines and trainer take text (or chat messages) only: drop it"
    ),
}


def _key(name: str) -> Callable[[dict[str, Any]], tuple[str, Any] | None]:
    """config.json's `name`, shown as `name value`, where the config has it."""
    return lambda c: (f"{name} {c[name]}", c[name]) if c.get(name) is not None else None


def _first_key(*names: str) -> Callable[[dict[str, Any]], tuple[str, Any] | None]:
    def get(c: dict[str, Any]) -> tuple[str, Any] | None:
        return next((_key(n)(c) for n in names if c.get(n) is not None), None)

    return get


def _num_query_groups(c: dict[str, Any]) -> tuple[str, Any] | None:
    if c.get("num_key_value_heads") is not None:
        return _key("num_key_value_heads")(c)
    heads = c.get("num_attention_heads")  # no key-value heads given: one per attention head
    return (
        None if heads is None else (f"num_attention_heads {heads} (no num_key_value_heads)", heads)
    )


def _kv_channels(c: dict[str, Any]) -> tuple[str, Any] | None:
    if c.get("head_dim") is not None:
        return _key("head_dim")(c)
    hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
    if not (hidden and heads):
        return None
    return f"hidden_size {hidden} / num_attention_heads {heads} (no head_dim)", hidden // heads


def _normalization(c: dict[str, Any]) -> tuple[str, Any] | None:
    if "rms_norm_eps" in c:
        return "rms_norm_eps (RMSNorm)", "RMSNorm"
    name = next((n for n in ("layer_norm_eps", "layer_norm_epsilon") if n in c), None)
    return (f"{name} (LayerNorm)", "LayerNorm") if name else None


def _rotary_base(c: dict[str, Any]) -> tuple[str, Any] | None:
    rope = c.get("rope_parameters")
    if isinstance(rope, dict) and rope.get("rope_theta") is not None:
        return f"rope_parameters.rope_theta {rope['rope_theta']}", rope["rope_theta"]
    return _key("rope_theta")(c)


def _untied(c: dict[str, Any]) -> tuple[str, Any] | None:
    tied = c.get("tie_word_embeddings")
    return None if tied is None else (f"tie_word_embeddings {json.dumps(tied)}", not tied)


def _swiglu(c: dict[str, Any]) -> tuple[str, Any] | None:
    act = c.get("hidden_act")
    return None if act is None else (f"hidden_act {act}", act in ("silu", "swish"))


# The model types whose layout megatron/model.py builds, and so whose parts are known by type.
_ROPE_TYPES = ("qwen2", "qwen3", "llama")


def _qkv_bias(c: dict[str, Any]) -> tuple[str, Any] | None:
    if c.get("attention_bias") is not None:
        return _key("attention_bias")(c)
    kind = c.get("model_type")
    return (f"model_type {kind} (QKV bias)", True) if kind == "qwen2" else None


def _qk_layernorm(c: dict[str, Any]) -> tuple[str, Any] | None:
    kind = c.get("model_type")
    if kind not in _ROPE_TYPES:
        return None
    return f"model_type {kind} ({'' if kind == 'qwen3' else 'no '}q/k norms)", kind == "qwen3"


def _no_linear_bias(c: dict[str, Any]) -> tuple[str, Any] | None:
    """--disable-bias-linear: no bias in the linear layers but QKV's (--add-qkv-bias); a
    Llama or Qwen3 attention_bias is on the output projection too."""
    biased = [k for k in ("mlp_bias", "attention_bias") if c.get(k)]
    if biased:
        return f"{biased[0]} true", False
    kind = c.get("model_type")
    return (f"model_type {kind} (no linear bias)", True) if kind in _ROPE_TYPES else None


def _position_embedding(c: dict[str, Any]) -> tuple[str, Any] | None:
    if c.get("rope_theta") is not None or isinstance(c.get("rope_parameters"), dict):
        return "rope_theta (rotary)", "rope"
    kind = c.get("model_type")
    return (f"model_type {kind} (rotary)", "rope") if kind in _ROPE_TYPES else None


# field -> what the checkpoint's config.json says it is: (shown, value), None where it does not.
MATCHED: dict[str, Callable[[dict[str, Any]], tuple[str, Any] | None]] = {
    "num_layers": _key("num_hidden_layers"),
    "hidden_size": _key("hidden_size"),
    "ffn_hidden_size": _key("intermediate_size"),
    "num_attention_heads": _key("num_attention_heads"),
    "num_query_groups": _num_query_groups,
    "kv_channels": _kv_channels,
    "normalization": _normalization,
    "norm_epsilon": _first_key("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"),
    "rotary_base": _rotary_base,
    "vocab_size": _key("vocab_size"),
    "max_position_embeddings": _key("max_position_embeddings"),
    "untie_embeddings_and_output_weights": _untied,
    "swiglu": _swiglu,
    "add_qkv_bias": _qkv_bias,
    "qk_layernorm": _qk_layernorm,
    "disable_bias_linear": _no_linear_bias,
    "position_embedding_type": _position_embedding,
}

_FROM_THE_MODEL_CODE = (
    "the HF checkpoint's modeling code builds this part of the model, and config.json has no "
    "portable key to check the flag against"
)

# field -> why it needs nothing here.
ACCEPTED: dict[str, str] = {
    "sglang_server_concurrency": (
        "Miles' client-side cap on in-flight requests per engine: plugins read it as "
        "args.sglang_server_concurrency (GenerateState's semaphore); millstream's own rollout "
        "is capped per worker by --rollout-max-concurrency"
    ),
    "accumulate_allreduce_grads_in_fp32": "the torch backend's gradients are fp32 already",
    "attention_softmax_in_fp32": "the torch backend computes in fp32 throughout",
    "group_query_attention": "switches on --num-query-groups, which is matched",
    "use_rotary_position_embeddings": _FROM_THE_MODEL_CODE,
    "opd_type": (
        "says where the teacher's logprobs come from, which the teacher flag given already "
        "says: megatron needs --opd-teacher-load (the trainer runs the teacher), sglang "
        "--opd-teacher-url (an engine scores the samples); a mismatch exits 2"
    ),
    "seq_length": (
        "a placeholder in Miles too (its Megatron runs take variable lengths); the lengths "
        "here are --rollout-max-prompt-len and --rollout-max-response-len"
    ),
}

# --sglang-* flag's field -> where it goes, for one that nothing here reads. The ones millstream
# names are read (--sglang-mem-fraction-static by launch/plan.py), and every other --sglang-X
# is collected into cfg.sglang.sglang_server_args (module docstring); sglang_dp_size repeats
# one of those, --sglang-dp-size, for plugins that read args.sglang_dp_size.
PASSED_THROUGH: dict[str, str] = {
    "sglang_dp_size": "SGLang's --dp-size, which --sglang-dp-size hands on; args.sglang_dp_size",
}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _value(cfg: RunConfig, field: str) -> Any:
    return getattr(getattr(cfg, _GROUP_OF[field]), field)


def _shown(field: str, value: Any) -> str:
    """The flag as given on the command line: `--colocate`, `--tensor-model-parallel-size 2`."""
    return flag_name(field) if isinstance(value, bool) else f"{flag_name(field)} {value}"


def _given(cfg: RunConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """The fields of `fields` this run gives a value other than the default (`--no-x` of a
    `bool | None` flag asks for nothing, as its default does)."""
    return {
        f: v
        for f in fields
        if (v := _value(cfg, f)) != _DEFAULT[f] and not (v is False and _DEFAULT[f] is None)
    }


# field -> (the --train-backend that reads it, why the others refuse it). Read, so in no table.
BACKEND_ONLY: dict[str, tuple[str, str]] = {
    "tensor_model_parallel_size": (
        "megatron",
        "needs --train-backend megatron (megatron-core's tensor parallelism, under torchrun "
        "with a multiple of it as ranks); the torch backend is data parallel, and "
        "--train-backend fsdp shards the model across the ranks",
    ),
    "context_parallel_size": (
        "megatron",
        "needs --train-backend megatron (each rank of a context parallel group takes a share "
        "of every sequence, under torchrun with a multiple of it as ranks); the torch backend "
        "runs whole sequences",
    ),
    "pipeline_model_parallel_size": (
        "megatron",
        "needs --train-backend megatron (megatron-core's pipeline stages, under torchrun with "
        "a multiple of it as ranks); the torch backend is data parallel, and --train-backend "
        "fsdp shards the model across the ranks",
    ),
    "sequence_parallel": (
        "megatron",
        "needs --train-backend megatron with --tensor-model-parallel-size > 1 (megatron's "
        "sequence parallelism splits the sequence over the tensor parallel ranks); the torch "
        "backend has no such split",
    ),
    "use_distributed_optimizer": (
        "megatron",
        "needs --train-backend megatron (megatron-core's distributed optimizer); the torch "
        "backend shards its optimizer state with --train-backend fsdp",
    ),
    "recompute_granularity": ("megatron", _NO_RECOMPUTE),
    "recompute_method": ("megatron", _NO_RECOMPUTE),
    "recompute_num_layers": ("megatron", _NO_RECOMPUTE),
}


def refused(cfg: RunConfig) -> dict[str, str]:
    """flag -> its message, for each refused flag this run gives: BACKEND_ONLY's for another
    backend, then REFUSED's, in that order."""
    found = {
        flag_name(f): f"{_shown(f, v)} {BACKEND_ONLY[f][1]}"
        for f, v in _given(cfg, BACKEND_ONLY).items()
        if cfg.ckpt.train_backend != BACKEND_ONLY[f][0]
    }
    return found | {
        flag_name(f): f"{_shown(f, v)} {REFUSED[f]}" for f, v in _given(cfg, REFUSED).items()
    }


def check(cfg: RunConfig) -> None:
    """ConfigError for the first refused flag given, naming the others after it."""
    found = refused(cfg)
    if not found:
        return
    first, *others = found
    more = f" (also refused: {', '.join(others)})" if others else ""
    raise ConfigError(found[first] + more)


def check_model(cfg: RunConfig) -> None:
    """ConfigError when a MATCHED flag given disagrees with the model's config.json (the actor:
    --hf-checkpoint, else --ref-load; preflight has checked the file is there)."""
    given = _given(cfg, MATCHED)
    flag, path = "--hf-checkpoint", cfg.ckpt.hf_checkpoint
    if not path:
        flag, path = "--ref-load", cfg.ckpt.ref_load
    if not given or not path:
        return
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{flag} {path}: cannot read its config.json ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{flag} {path}: its config.json is not a JSON object")
    if isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal model: its language model's
    for field, value in given.items():
        found = MATCHED[field](config)
        if found is None:
            continue  # the config does not say: the modeling code decides
        shown, expected = found
        if not _same(value, expected):
            raise ConfigError(
                f"{_shown(field, value)} disagrees with the model: {flag} {path} has {shown} "
                "in its config.json, which the trainer builds the model from: fix the flag or "
                "drop it"
            )


def _same(given: Any, expected: Any) -> bool:
    if isinstance(given, float) or isinstance(expected, float):
        return isinstance(expected, int | float) and math.isclose(given, expected, rel_tol=1e-9)
    return given == expected
