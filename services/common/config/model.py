"""Model and checkpoint flags (Miles' CKPT_ARGS), plus the Megatron flags of MODEL_ARGS and
PERF_ARGS that Miles launch scripts carry. The torch backend takes the architecture from the
Hugging Face config; the Megatron flags are accepted so a Miles script parses unchanged, and
the Megatron backend will read them."""

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
    train_backend: str = flag("torch", "training backend", choices=("torch", "megatron"))

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval <= 0:
            raise ConfigError(f"--save-interval must be > 0 (got {self.save_interval})")


@dataclass(frozen=True)
class MegatronConfig:
    tensor_model_parallel_size: int = flag(1, "")
    pipeline_model_parallel_size: int = flag(1, "")
    context_parallel_size: int = flag(1, "")
    expert_model_parallel_size: int = flag(1, "")
    expert_tensor_parallel_size: int = flag(1, "")
    sequence_parallel: bool = flag(False, "")
    recompute_granularity: str | None = flag(None, "", choices=("full", "selective"))
    recompute_method: str | None = flag(None, "", choices=("uniform", "block"))
    recompute_num_layers: int | None = flag(None, "")
    num_layers: int | None = flag(None, "")
    hidden_size: int | None = flag(None, "")
    ffn_hidden_size: int | None = flag(None, "")
    num_attention_heads: int | None = flag(None, "")
    group_query_attention: bool = flag(False, "")
    num_query_groups: int | None = flag(None, "")
    kv_channels: int | None = flag(None, "")
    swiglu: bool = flag(False, "")
    disable_bias_linear: bool = flag(False, "")
    add_qkv_bias: bool = flag(False, "")
    normalization: str | None = flag(None, "", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float | None = flag(None, "")
    use_rotary_position_embeddings: bool = flag(False, "")
    rotary_base: float | None = flag(None, "")
    vocab_size: int | None = flag(None, "")
    max_position_embeddings: int | None = flag(None, "")
    seq_length: int | None = flag(None, "")
    qk_layernorm: bool = flag(False, "")
    untie_embeddings_and_output_weights: bool = flag(False, "")
    attention_dropout: float = flag(0.0, "")
    hidden_dropout: float = flag(0.0, "")
    accumulate_allreduce_grads_in_fp32: bool = flag(False, "")
    attention_softmax_in_fp32: bool = flag(False, "")
    attention_backend: str | None = flag(None, "")
    bf16: bool = flag(False, "")
    actor_num_nodes: int = flag(1, "trainer nodes")
    actor_num_gpus_per_node: int = flag(1, "trainer ranks per node (torchrun --nproc-per-node)")
    colocate: bool = flag(False, "accepted for Miles scripts; millstream always runs disaggregated")
