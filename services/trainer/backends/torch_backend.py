"""The torch backend: a Hugging Face causal LM as the actor, trained with a torch optimizer (and,
for PPO, a critic with its own optimizer) in the step loop both backends share (loop.py).

What is its own: the actor is the Hugging Face model itself (its optimizer built before it is
cast to the --bf16 dtype, `_start_actor`); the samples of a micro-batch that share a prompt
forward it once (shared_prefix.py) where every model here takes the mask (`_shared_prompt_mask`
probes each) and that computes less, for the same gradient; its weights leave in their own
names (`named_weights`, the gathered full ones when FSDP shards them) and a checkpoint's
model/ safetensors load straight into it (`load_weights`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from .loop import StepLoop
from .rows import shared_prompt_mask


class TorchBackend(StepLoop):
    def _start_actor(self) -> None:
        """The actor's optimizer, then the actor in its dtype: the masters copy the
        checkpoint's fp32 weights before the cast to bf16 (the megatron backend builds its
        own actor and does the same with it)."""
        self.make_actor_optimizer()
        self.model.to(self.dtype)

    def _shared_prompt_mask(self) -> str | None:
        """`prompt_mask`: the mask kind every model here takes, found by forwarding a probe
        both ways (a model whose attention drops a custom 4-D mask fails it), or None."""
        if self.cfg.perf.shared_prefix is False:
            return None
        return shared_prompt_mask(
            [self.model, self.ref, self.teacher, self.critic],
            self.model.config.vocab_size,
            self.cfg.perf.use_dynamic_batch_size,
            next(self.model.parameters()).dtype,
            self.on_device,
        )

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.full_weights is not None:  # sharded: what the last gather collected
            yield from self.full_weights.items()
            return
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def load_weights(self, directory: Path) -> None:
        """The actor's weights from a checkpoint (before FSDP shards them)."""
        from safetensors.torch import load_model

        load_model(self.model, str(directory / "model" / "model.safetensors"), strict=False)
        if self.master is not None:  # until the optimizer's state brings the fp32 ones
            self.master.from_model()
