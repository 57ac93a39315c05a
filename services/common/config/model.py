"""Model and checkpoint flags (Miles' CKPT_ARGS), plus the Megatron flags of MODEL_ARGS and
PERF_ARGS that Miles launch scripts carry. The torch backend takes the architecture from the
Hugging Face config: a Miles script parses unchanged, and then each Megatron flag is matched
against the checkpoint's config.json, refused (exit 2) when it asks for what the torch backend
does not do, or accepted where there is nothing to do; --help says which, and
common/config/refusals.py holds the rule and the tables."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag


@dataclass(frozen=True)
class CkptConfig:
    hf_checkpoint: str | None = flag(
        None, "Hugging Face model dir: tokenizer, config and the starting weights"
    )
    ref_load: str | None = flag(
        None, "reference model (KL); also the actor's start when --load is empty"
    )
    load: str | None = flag(
        None, "resume from this checkpoint dir (latest_checkpointed_iteration.txt)"
    )
    save: str | None = flag(None, "write checkpoints here")
    save_interval: int | None = flag(
        None, "checkpoint every N rollouts (the last rollout always saves)"
    )
    no_save_optim: bool = flag(False, "do not save optimizer state")
    no_load_optim: bool = flag(False, "do not load optimizer state")
    seed: int = flag(1234, "trainer random seed")
    train_backend: str = flag(
        "torch",
        "torch: the Hugging Face model, data parallel under torchrun (DDP); fsdp: the same, "
        "sharded across the torchrun ranks (torch's FSDP2, Miles' name); megatron: "
        "megatron-core's GPTModel built from the checkpoint, data and tensor parallel "
        "(--tensor-model-parallel-size) under torchrun; PP=CP=1 so far",
        choices=("torch", "fsdp", "megatron"),
    )

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError(f"--save-interval must be > 0 (got {self.save_interval})")


# What --help says of the Megatron flags (common/config/refusals.py decides, and says why).
_PARALLEL = "; only 1 (not built yet): anything else exits 2"
_RECOMPUTE = "Megatron's activation recomputation: --train-backend megatron only"
_DROPOUT = "Megatron's dropout; only 0 with the torch backend (the HF config's dropout applies)"
_FROM_HF = "checked against the HF checkpoint's config.json ({}): given values must match"
_MODEL_CODE = "accepted: the HF checkpoint's modeling code decides it (not checked)"


@dataclass(frozen=True)
class MegatronConfig:
    tensor_model_parallel_size: int = flag(
        1,
        "Megatron tensor parallelism: --train-backend megatron only, under torchrun with a "
        "multiple of it as ranks (the rest data parallel)",
    )
    pipeline_model_parallel_size: int = flag(
        1,
        "Megatron pipeline parallelism: --train-backend megatron only, under torchrun with a "
        "multiple of it as ranks",
    )
    context_parallel_size: int = flag(
        1,
        "Megatron context parallelism (each sequence split over the ranks): --train-backend "
        "megatron only, under torchrun with a multiple of it as ranks",
    )
    expert_model_parallel_size: int = flag(1, "Megatron expert parallelism" + _PARALLEL)
    expert_tensor_parallel_size: int = flag(1, "Megatron expert tensor parallelism" + _PARALLEL)
    sequence_parallel: bool = flag(
        False,
        "Megatron sequence parallelism over the tensor parallel ranks (--train-backend "
        "megatron; off with one tensor parallel rank, as in Megatron-LM)",
    )
    use_distributed_optimizer: bool = flag(
        False,
        "--train-backend megatron on GPUs: megatron's DistributedDataParallel and distributed "
        "optimizer (Adam's state sharded over the data parallel ranks); on CPU the plain torch "
        "optimizer takes the same step. Not with tensor, pipeline or context parallelism yet",
    )
    recompute_granularity: str | None = flag(None, _RECOMPUTE, choices=("full", "selective"))
    recompute_method: str | None = flag(None, _RECOMPUTE, choices=("uniform", "block"))
    recompute_num_layers: int | None = flag(None, _RECOMPUTE)
    num_layers: int | None = flag(None, _FROM_HF.format("num_hidden_layers"))
    hidden_size: int | None = flag(None, _FROM_HF.format("hidden_size"))
    ffn_hidden_size: int | None = flag(None, _FROM_HF.format("intermediate_size"))
    num_attention_heads: int | None = flag(None, _FROM_HF.format("num_attention_heads"))
    group_query_attention: bool = flag(False, "accepted: switches on --num-query-groups")
    num_query_groups: int | None = flag(None, _FROM_HF.format("num_key_value_heads"))
    kv_channels: int | None = flag(None, _FROM_HF.format("head_dim"))
    swiglu: bool = flag(False, _FROM_HF.format("hidden_act silu"))
    disable_bias_linear: bool = flag(False, _FROM_HF.format("model_type, mlp_bias"))
    add_qkv_bias: bool = flag(False, _FROM_HF.format("model_type qwen2, attention_bias"))
    normalization: str | None = flag(
        None, _FROM_HF.format("rms_norm_eps: RMSNorm"), choices=("LayerNorm", "RMSNorm")
    )
    norm_epsilon: float | None = flag(None, _FROM_HF.format("rms_norm_eps"))
    use_rotary_position_embeddings: bool = flag(False, _MODEL_CODE)
    position_embedding_type: str | None = flag(
        None, _FROM_HF.format("rope_theta: rope"), choices=("rope", "learned_absolute", "none")
    )
    rotary_base: float | None = flag(None, _FROM_HF.format("rope_theta"))
    vocab_size: int | None = flag(None, _FROM_HF.format("vocab_size"))
    max_position_embeddings: int | None = flag(None, _FROM_HF.format("max_position_embeddings"))
    seq_length: int | None = flag(
        None, "accepted: a placeholder in Miles too; lengths come from --rollout-max-*-len"
    )
    qk_layernorm: bool = flag(False, _FROM_HF.format("model_type qwen3"))
    untie_embeddings_and_output_weights: bool = flag(
        False, _FROM_HF.format("tie_word_embeddings false")
    )
    attention_dropout: float = flag(0.0, _DROPOUT)
    hidden_dropout: float = flag(0.0, _DROPOUT)
    accumulate_allreduce_grads_in_fp32: bool = flag(
        False, "accepted: the torch backend's gradients are fp32 already"
    )
    attention_softmax_in_fp32: bool = flag(
        False, "accepted: the torch backend computes in fp32 throughout"
    )
    attention_backend: str | None = flag(
        None, "Megatron's attention kernel; refused by the torch backend (the HF model's own)"
    )
    actor_num_nodes: int = flag(1, "trainer nodes")
    actor_num_gpus_per_node: int = flag(1, "trainer ranks per node (torchrun --nproc-per-node)")
