"""megatron-core on CPU: the few places where it assumes CUDA, made to run on the CPU.

megatron-core 0.16.1 is written for GPUs; building and running a `GPTModel` (local spec, no
Transformer Engine) on a CPU-only torch trips over six things, each patched here:

1. `torch.cuda.current_device()` used as a device (rotary embeddings move `inv_freq` to it in
   `RotaryEmbedding.get_emb`; attention, the GPT model and the transformer layer allocate
   buffers on it). On a CPU-only build it raises; here it answers "cpu".
2. `megatron.core.transformer.utils.get_default_causal_mask` builds its mask with the literal
   `device="cuda"`; `FusedScaleMaskSoftmax.forward_torch_softmax` (fusions/fused_softmax.py,
   which imported it by name) calls it when attention gets no explicit mask: a CPU version
   replaces it in both modules.
3. `tensor_parallel.get_cuda_rng_tracker()`, forked around attention dropout
   (`DotProductAttention.forward`) and used at init, keeps CUDA RNG states: a tracker whose
   `fork` is a no-op replaces it (millstream trains without dropout; common/config/refusals.py refuses
   --attention-dropout/--hidden-dropout other than 0).
4. Activation recomputation (--recompute-granularity) runs through
   `tensor_parallel.random.CheckpointFunction`, which saves the CUDA RNG state before a
   recomputed forward and restores it around the recompute (`_get_all_rng_states`,
   `_set_all_rng_states`, `_fork_rng`, looking up `_get_cuda_rng_state` and
   `_set_cuda_rng_state` in their module); a CPU-only torch has no CUDA RNG to read: an empty
   state stands in, and setting it does nothing (the CPU RNG state, which it saves too, is
   torch's own).
5. Saving a torch_dist checkpoint (`dist_checkpointing.save`, megatron/dist.py) stages the
   tensors to host memory in `FileSystemWriterAsync.preload_tensors` with a non-blocking
   copy and then `torch.cuda.synchronize()`; on CPU the tensors are there already: the copy
   is made blocking, which skips the synchronize.
6. Context parallelism: `RotaryEmbedding.forward` takes this rank's positions with
   `rope_utils.get_pos_emb_on_this_cp_rank`, which builds its index in pinned memory and moves
   it to CUDA: a CPU version replaces it where rotary_pos_embedding.py imported it by name.

`apply()` patches once, and only when torch has no CUDA: it is called by the Megatron model
builder (megatron/model.py) when it starts, never at import time. On a GPU nothing is patched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

_APPLIED = False


class CpuRngTracker:
    """Stands in for megatron's CudaRNGStatesTracker: no CUDA RNG states to fork on CPU."""

    def fork(self, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def add(self, name: str, seed: int) -> None:
        pass

    def is_initialized(self) -> bool:
        return True

    def reset(self) -> None:
        pass

    def get_states(self) -> dict:
        return {}

    def set_states(self, states: dict) -> None:
        pass


_TRACKER = CpuRngTracker()


def _cpu_pos_emb_on_this_cp_rank(
    pos_emb: torch.Tensor, seq_dim: int, cp_group: Any
) -> torch.Tensor:
    """rope_utils.get_pos_emb_on_this_cp_rank without its pinned CUDA index: this context
    parallel rank's 2 of 2 x size chunks along `seq_dim`."""
    size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - rank - 1])
    chunked = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1 :])
    picked = chunked.index_select(seq_dim, index)
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2 :])


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def apply() -> bool:
    """Patch megatron-core for a CPU-only torch (see the module docstring); True when the
    patches are in place, False on a machine with CUDA (nothing to do). Idempotent."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.utils as transformer_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # 1. RotaryEmbedding.get_emb, Attention, GPTModel, TransformerLayer: device=current_device()
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    # 2. the default causal mask, get_default_causal_mask(device="cuda"), where it is looked up
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    # 3. DotProductAttention.forward: `with tensor_parallel.get_cuda_rng_tracker().fork()`
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: _TRACKER
    tp_random.get_cuda_rng_tracker = lambda *args, **kwargs: _TRACKER
    # 4. CheckpointFunction (activation recomputation): the CUDA RNG state it saves and restores
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    # 5. FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True): blocking on CPU
    writer = filesystem_async.FileSystemWriterAsync
    preload = writer.preload_tensors
    writer.preload_tensors = staticmethod(
        lambda buckets, non_blocking=True: preload(buckets, False)
    )  # type: ignore[method-assign]
    # 6. RotaryEmbedding.forward: get_pos_emb_on_this_cp_rank, imported by name
    rotary.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    _APPLIED = True
    return True


@contextlib.contextmanager
def model_parallel(tensor: int = 1, pipeline: int = 1) -> Iterator[None]:
    """megatron's parallel state over the default process group (which must exist), torn
    down after."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor, pipeline)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
