"""`--bf16` with Megatron's meaning: the model computes in bf16, the optimizer steps fp32 masters.

    master = MasterWeights(params)       bf16 params; an fp32 copy of each (the master)
    optimizer = make_optimizer(master.params, ...)     its state fp32 like the masters
    loss.backward()                      each bf16 grad is added into its master's fp32 grad
                                         as it lands (a post-accumulate hook), then dropped
    clip_grad_norm_(master.params, ...); optimizer.step()
    master.to_model()                    the bf16 weights, rounded from the stepped masters

So the weights the engines get and every forward's activations are bf16, while what the
optimizer accumulates is not rounded away: an update smaller than a bf16 weight's spacing (lr
1e-6 on a weight of 1: bf16 keeps 8 bits of mantissa, a step of 2^-8 ~ 4e-3) moves the master
and reaches the bf16 weight once the masters' sum crosses it. Gradients of several micro-batches
are summed in fp32 on the master (Megatron's main_grad), not in bf16 on the parameter. Log-probs,
the loss and its reductions are fp32 (the backend upcasts the logits before the softmax).

The masters are checkpointed with the optimizer (`state_dict`), so a resume continues from the
fp32 weights, not from the bf16 ones the Hugging Face `model/` holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MasterWeights:
    """fp32 masters of bf16 parameters, and the hooks that move their gradients over."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.model_params = [p for p in params if p.requires_grad]
        self.params = [
            torch.nn.Parameter(p.detach().to(torch.float32).clone()) for p in self.model_params
        ]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._move_grad(m))
            for p, m in zip(self.model_params, self.params, strict=True)
        ]

    @staticmethod
    def _move_grad(master: torch.nn.Parameter) -> Any:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            param.grad = None

        return hook

    def to_model(self) -> None:
        """The bf16 parameters from the masters (after every optimizer step)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.params, strict=True):
                p.copy_(m)

    def from_model(self) -> None:
        """The masters from the bf16 parameters (weights loaded into the model)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.params, strict=True):
                m.copy_(p)

    def state_dict(self) -> dict[str, Any]:
        return {"master": [m.detach().clone() for m in self.params]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = state["master"]
        if len(masters) != len(self.params):
            raise ValueError(
                f"master weights: {len(masters)} saved, the model has {len(self.params)}"
            )
        with torch.no_grad():
            for m, saved in zip(self.params, masters, strict=True):
                if m.shape != saved.shape:
                    raise ValueError(
                        f"master weights: {tuple(saved.shape)} saved for {tuple(m.shape)}"
                    )
                m.copy_(saved)
        self.to_model()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
