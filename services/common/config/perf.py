"""Performance flags (Miles' PERF_ARGS): micro-batches and dynamic batching."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError
from .schema import flag


@dataclass(frozen=True)
class PerfConfig:
    micro_batch_size: int = flag(1, "samples per micro-batch (gradient accumulation)")
    use_dynamic_batch_size: bool = flag(
        False, "pack micro-batches by tokens under --max-tokens-per-gpu"
    )
    max_tokens_per_gpu: int | None = flag(None, "token cap of a packed micro-batch")
    balance_data: bool = flag(False, "even out tokens across data-parallel ranks")
    shared_prefix: bool | None = flag(
        None,
        "millstream: forward a prompt once for the samples of a micro-batch that share it, "
        "where that computes less (default; --no-shared-prefix: each sample whole, as Miles)",
    )
    bf16: bool = flag(
        False,
        "bf16 training as Megatron means it: bf16 weights and activations, fp32 master "
        "weights, optimizer state, log-probs and loss (every --train-backend, any ranks)",
    )
    log_probs_chunk_size: int = flag(
        -1,
        "Miles: the response positions whose vocabulary-wide logits and log-softmax exist at "
        "once (the peak of a GRPO step with a large vocabulary); -1: all of a micro-batch's",
    )

    def __post_init__(self) -> None:
        if self.log_probs_chunk_size == 0 or self.log_probs_chunk_size < -1:
            raise ConfigError(
                f"--log-probs-chunk-size must be > 0, or -1 for none (got {self.log_probs_chunk_size})"
            )
        if self.micro_batch_size <= 0:
            raise ConfigError(f"--micro-batch-size must be > 0 (got {self.micro_batch_size})")
        if self.use_dynamic_batch_size and not self.max_tokens_per_gpu:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
