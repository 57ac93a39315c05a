"""The Megatron backend's model: a megatron-core `GPTModel` built from a Hugging Face config,
and the weights converted both ways (issue 15; megatron/backend.py trains it).

`transformer_config(hf)` maps a Qwen2 / Qwen3 / Llama config.json to megatron's
TransformerConfig (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention, QKV bias where
the model has it, no dropout); `build(hf)` makes the GPTModel with the local (non Transformer
Engine) layer spec, on CPU with `megatron_cpu.apply()`, tensor parallel over megatron's
parallel state (`tensor_parallel` ranks: its vocabulary padded to a multiple of them, the
logits gathered whole on every rank).

Weights (`hf_to_megatron`, `megatron_to_hf`, inverse of each other):

    model.embed_tokens.weight                -> embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight    -> decoder.layers.i.input_layernorm.weight
    q_proj, k_proj, v_proj (weight, bias)    -> self_attention.linear_qkv (fused)
    model.layers.i.self_attn.o_proj.weight   -> self_attention.linear_proj.weight
    post_attention_layernorm.weight          -> pre_mlp_layernorm.weight
    gate_proj, up_proj                       -> mlp.linear_fc1.weight (gate rows, then up)
    down_proj                                -> mlp.linear_fc2.weight
    model.norm.weight                        -> decoder.final_layernorm.weight
    lm_head.weight (tied: embed_tokens)      -> output_layer.weight (none where tied and whole)

The fused QKV is megatron's layout: per query group, that group's query heads, then its key
head, then its value head (rows of head_dim each). Qwen3's q_norm/k_norm are the layer's
q_layernorm/k_layernorm.

bf16 (--bf16): TransformerConfig(bf16=True), so that megatron's attention takes bf16 scores and
softmaxes them in fp32 (attention_softmax_in_fp32); the model is built and loaded in fp32 (the
checkpoint's weights, which the backend's fp32 masters copy), then cast to bf16 (`cast`: what
megatron's Float16Module does to the module it wraps, its config's params_dtype saying so). The
logits leave in bf16 and the backend upcasts them before the softmax, as Float16Module would.

Tensor parallel (`shard`, `unshard`): each rank holds a slice of every layer megatron splits
(the parameter's `partition_dim`): rows of the fused QKV (whole query groups: the layout above
keeps a group's rows together), of the embedding and output layer (the padded vocabulary), and
of linear_fc1 (gate rows and up rows each split, megatron's SwiGLU chunks its own slice in
two), columns of linear_proj and linear_fc2. Norms are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from millstream.common.errors import MillstreamError

from . import cpu as megatron_cpu

SUPPORTED = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Layout:
    """How the model is split over the ranks: Megatron's parallel sizes (--tensor-model-
    parallel-size, --pipeline-model-parallel-size, --context-parallel-size) and whether the
    tensor parallel ranks also split the sequence between the layers (--sequence-parallel)."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    sequence: bool = False


def _rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    return float(getattr(hf, "rope_theta", None) or params.get("rope_theta", 10000.0))


def _head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def padded_vocab(hf: Any, tensor_parallel: int) -> int:
    """The vocabulary rounded up to a multiple of the tensor parallel size (megatron splits
    the embedding's rows evenly); the extra rows are zero and their logits dropped."""
    return -(-hf.vocab_size // tensor_parallel) * tensor_parallel


def unpadded_logits(logits: torch.Tensor, hf: Any) -> torch.Tensor:
    """The logits of the model's own vocabulary: those of `padded_vocab`'s extra rows dropped."""
    return logits[..., : hf.vocab_size]


def transformer_config(
    hf: Any,
    layout: Layout = Layout(),
    recompute: dict[str, Any] | None = None,
    bf16: bool = False,
) -> Any:
    """megatron's TransformerConfig for the Hugging Face config `hf` split as `layout` says;
    `recompute`: Miles' --recompute-granularity/-method/-num-layers as TransformerConfig's
    recompute_* fields; `bf16`: the model will compute in bf16 (module docstring)."""
    tensor_parallel, pipeline_parallel = layout.tensor, layout.pipeline
    if hf.model_type not in SUPPORTED:
        raise MillstreamError(
            f"the Megatron backend builds {', '.join(SUPPORTED)} models; this checkpoint is "
            f"{hf.model_type!r}"
        )
    split = {"attention heads": hf.num_attention_heads, "key-value heads":
             hf.num_key_value_heads, "intermediate size": hf.intermediate_size}  # fmt: skip
    if uneven := [f"{name} {n}" for name, n in split.items() if n % tensor_parallel]:
        raise MillstreamError(
            f"--tensor-model-parallel-size {tensor_parallel} must divide the model's "
            f"{', '.join(uneven)}: each rank holds an equal slice of them"
        )
    if hf.num_hidden_layers % pipeline_parallel:
        raise MillstreamError(
            f"--pipeline-model-parallel-size {pipeline_parallel} must divide the model's "
            f"{hf.num_hidden_layers} layers: each stage holds an equal share of them"
        )
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise MillstreamError(
            "the Megatron backend builds linear layers without bias but QKV's; this checkpoint "
            "has attention_bias (on the output projection too) or mlp_bias: train it with "
            "--train-backend torch"
        )
    qkv_bias = hf.model_type == "qwen2"
    try:
        config = _transformer_config(hf, layout, qkv_bias, recompute or {}, bf16)
        config.sequence_parallel = layout.sequence and tensor_parallel > 1
        return config
    except (ValueError, AssertionError) as err:  # megatron's own validation of the settings
        raise MillstreamError(f"megatron-core refuses the model's settings: {err}") from None


def _transformer_config(
    hf: Any, layout: Layout, qkv_bias: bool, recompute: dict[str, Any], bf16: bool
) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=_head_dim(hf),
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        qk_layernorm=hf.model_type == "qwen3",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # the fused kernels are CUDA's; the local spec's plain paths are exact on CPU
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        bf16=bf16,
        params_dtype=torch.float32,  # bf16 after `cast`
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        pipeline_dtype=torch.float32,
        context_parallel_size=layout.context,
        **{f"recompute_{k}": v for k, v in recompute.items() if v is not None},
    )


class SequenceNorm:
    """megatron's WrappedTorchNorm (torch's RMSNorm) without its refusal of sequence
    parallelism, for the norms on the residual stream. Under sequence parallelism each
    tensor parallel rank normalises its slice of the sequence, so the weight's gradient is
    that slice's share: marked `sequence_parallel`, the backend sums it over the group."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        return norm


class HeadNorm:
    """Qwen3's q/k norms as torch's RMSNorm, whatever the sequence layout: they run after the
    sequence is gathered. Whole on every tensor parallel rank, each applies them to its own
    heads only, so the weight's gradient is those heads' share: marked `partial_over_heads`,
    the backend sums it over the group."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.partial_over_heads = config.tensor_model_parallel_size > 1  # type: ignore[attr-defined]
        return norm


def _layer_spec(qk_layernorm: bool, context_parallel: bool) -> Any:
    """The local (non Transformer Engine) layer spec with our norms in it (SequenceNorm,
    HeadNorm): the same modules megatron's torch norm builds, sequence parallel or not; with
    context parallelism, our core attention (megatron/context.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceNorm
    attention = layer.self_attention.submodules
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = HeadNorm
    if context_parallel:
        from .context import ContextParallelAttention

        attention.core_attention = ContextParallelAttention
    return spec


def _seed_cuda_rng_tracker(seed: int) -> None:
    """On a GPU megatron initialises its layers' weights (and runs attention dropout) under
    its CUDA RNG tracker, which needs its states (on a CPU-only torch megatron/cpu.py stands in
    for it)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build(
    hf: Any,
    layout: Layout = Layout(),
    recompute: dict[str, Any] | None = None,
    seed: int = 0,
    bf16: bool = False,
) -> torch.nn.Module:
    """The GPTModel for `hf` (random weights: load them with `hf_to_megatron` and `shard`).
    Needs the default process group and megatron's parallel state with `layout`'s sizes
    (megatron_cpu.model_parallel). Its logits are the whole padded vocabulary. Sequence
    parallel (with more than one tensor parallel rank), a forward's sequence length must be
    a multiple of the tensor parallel size. With pipeline stages, this
    rank's stage: its share of the layers (`layer_offset` says which), the embedding on the
    first, the final norm and output layer on the last; a tied model is built untied there
    (the two copies kept equal by the backend, as megatron's embedding group does). With
    context parallel ranks, a forward takes this rank's share of the sequence
    (megatron_context.split). On a GPU `seed` seeds megatron's CUDA RNG tracker. `bf16`: its
    config's; the parameters are fp32 until `cast`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if not megatron_cpu.apply():
        _seed_cuda_rng_tracker(seed)
    config = transformer_config(hf, layout, recompute, bf16)
    layer = _layer_spec(config.qk_layernorm, layout.context > 1)
    spec = TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=SequenceNorm
    )
    return GPTModel(
        config,
        spec,
        vocab_size=padded_vocab(hf, layout.tensor),
        max_sequence_length=hf.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="rope",
        rotary_base=int(_rope_theta(hf)),
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings) and layout.pipeline == 1,
        # every rank gets the whole vocabulary's logits: the loss code is the torch backend's
        parallel_output=False,
    )


def cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The model's parameters in `dtype`, and its config's params_dtype and pipeline_dtype."""
    model.to(dtype)
    model.config.params_dtype = model.config.pipeline_dtype = dtype


def layer_offset(model: torch.nn.Module) -> int:
    """The global index of this pipeline stage's first layer (0 without pipelining)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config)


def _global_name(name: str, offset: int) -> str:
    """A stage's parameter name with its layer index made global: decoder.layers.1. on the
    second of two 2-layer stages is decoder.layers.3."""
    if not offset or not name.startswith("decoder.layers."):
        return name
    index, rest = name.removeprefix("decoder.layers.").split(".", 1)
    return f"decoder.layers.{int(index) + offset}.{rest}"


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf: Any) -> torch.Tensor:
    groups, d = hf.num_key_value_heads, _head_dim(hf)
    per_group = hf.num_attention_heads // groups * d
    rest = q.shape[1:]
    parts = [q.reshape(groups, per_group, *rest), k.reshape(groups, d, *rest),
             v.reshape(groups, d, *rest)]  # fmt: skip
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, hf: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = hf.num_key_value_heads, _head_dim(hf)
    per_group = hf.num_attention_heads // groups * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _layer_names(hf: Any, i: int) -> list[tuple[str, str]]:
    """(HF name, megatron name) of layer i's one-to-one weights."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    pairs = [
        ("input_layernorm.weight", "input_layernorm.weight"),
        ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
        ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
        ("mlp.down_proj.weight", "mlp.linear_fc2.weight"),
    ]
    if hf.model_type == "qwen3":
        pairs += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                  ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]  # fmt: skip
    return [(h + a, m + b) for a, b in pairs]


def hf_to_megatron(state: dict[str, torch.Tensor], hf: Any) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict in megatron's names and layouts (TP 1)."""
    out = {
        "embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": state["model.norm.weight"],
    }
    # Tied, a pipeline's last stage holds its own copy of the embedding as the output layer.
    out["output_layer.weight"] = state["model.embed_tokens.weight" if hf.tie_word_embeddings
                                       else "lm_head.weight"]  # fmt: skip
    for i in range(hf.num_hidden_layers):
        h, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        out.update({b: state[a] for a, b in _layer_names(hf, i)})
        for kind in ("weight", "bias"):
            if h + "q_proj." + kind in state:
                out[m + "self_attention.linear_qkv." + kind] = _fuse_qkv(
                    state[h + "q_proj." + kind], state[h + "k_proj." + kind],
                    state[h + "v_proj." + kind], hf,
                )  # fmt: skip
        mlp = f"model.layers.{i}.mlp."
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [state[mlp + "gate_proj.weight"], state[mlp + "up_proj.weight"]]
        )
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], hf: Any) -> dict[str, torch.Tensor]:
    """`hf_to_megatron`'s inverse: megatron's weights under Hugging Face names (what a weight
    sync sends to the engines and what a checkpoint saves)."""
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    if not hf.tie_word_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(hf.num_hidden_layers):
        h, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        out.update({a: state[b] for a, b in _layer_names(hf, i)})
        for kind in ("weight", "bias"):
            fused = state.get(m + "self_attention.linear_qkv." + kind)
            if fused is not None:
                q, k, v = _split_qkv(fused, hf)
                out.update({h + "q_proj." + kind: q, h + "k_proj." + kind: k,
                            h + "v_proj." + kind: v})  # fmt: skip
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2)
        out[f"model.layers.{i}.mlp.gate_proj.weight"] = gate
        out[f"model.layers.{i}.mlp.up_proj.weight"] = up
    return out


_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load `state` (megatron names, this rank's slices) into `model`: an error naming
    `source` when a parameter is left out or one is left over (megatron's _extra_state aside)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("_extra_state")]
    if missing or unexpected:
        raise MillstreamError(
            f"{source} does not match the Megatron model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def shard(
    full: dict[str, torch.Tensor], model: torch.nn.Module, tensor_parallel: int, rank: int
) -> dict[str, torch.Tensor]:
    """`hf_to_megatron`'s whole weights as tensor parallel rank `rank` of `tensor_parallel`
    holds them in `model` (the vocabulary padded with zero rows first)."""
    out, offset = {}, layer_offset(model)
    for name, param in model.named_parameters():
        value = full[_global_name(name, offset)]
        if name in _VOCAB_ROWS and value.shape[0] < param.shape[0] * tensor_parallel:
            pad = param.shape[0] * tensor_parallel - value.shape[0]
            value = torch.cat([value, value.new_zeros(pad, *value.shape[1:])])
        if getattr(param, "tensor_model_parallel", False) and tensor_parallel > 1:
            if name.endswith("mlp.linear_fc1.weight"):
                gate, up = value.chunk(2)
                value = torch.cat(
                    [gate.chunk(tensor_parallel)[rank], up.chunk(tensor_parallel)[rank]]
                )
            else:
                value = value.chunk(tensor_parallel, dim=param.partition_dim)[rank]
        out[name] = value.contiguous()
    return out


def unshard(
    model: torch.nn.Module, hf: Any, tensor_parallel: int, all_gather: Any
) -> dict[str, torch.Tensor]:
    """`shard`'s inverse over the tensor parallel group: every rank of it calls this (the same
    parameters in the same order) and gets the whole weights in megatron's names, unpadded
    (a pipeline stage: its own, with global layer indices). `all_gather(tensor) -> [each
    rank's tensor]`."""
    out, offset = {}, layer_offset(model)
    for name, param in model.named_parameters():
        value = param.detach()
        if getattr(param, "tensor_model_parallel", False) and tensor_parallel > 1:
            parts = all_gather(value.contiguous())
            if name.endswith("mlp.linear_fc1.weight"):
                halves = [p.chunk(2) for p in parts]
                value = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
            else:
                value = torch.cat(parts, dim=param.partition_dim)
        if name in _VOCAB_ROWS:
            value = value[: hf.vocab_size]
        out[_global_name(name, offset)] = value
    return out


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, S, V] logits of a causal forward over unpadded rows (positions 0..S-1)."""
    positions = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
    return model(input_ids, positions, attention_mask=None)
