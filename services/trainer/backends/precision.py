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

Where each backend keeps them (docs/backends.md, "bf16 training"):

- the torch backend, one rank or data parallel: these masters. With several ranks nothing wraps
  the actor in DDP (its buckets would sum the bf16 gradients); after each step's backward the
  masters' fp32 gradients are summed over the ranks instead (`sum_grads`, which DataParallel
  makes the backend's `sum_master_gradients`), so every rank steps the same masters alike;
- --train-backend fsdp: FSDP2's own mixed precision (`MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`, backends/distributed.py): its fp32 shards are the masters, gathered to
  bf16 for each forward and backward, the gradients reduce-scattered in fp32;
- --train-backend megatron: megatron's TransformerConfig(bf16=True) and the model cast to bf16
  (megatron/model.py), with these masters: megatron's own Float16OptimizerWithFloat16Params
  and distributed optimizer need CUDA. Its tensor, pipeline and context parallel gradient sums
  and its clipping read each parameter's gradient where it is kept (`master_of`).
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
        self._master = dict(zip(self.model_params, self.params, strict=True))
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

    def master_of(self, param: torch.Tensor) -> torch.nn.Parameter:
        """The master of a model parameter: the one whose `.grad` holds its gradient."""
        return self._master[param]

    def sum_grads(self, group: Any = None, bucket: int = 1 << 24) -> None:
        """Sum the masters' fp32 gradients over the ranks of `group` (None: all): every rank
        calls it after its backward and ends with the same sums. In flat buckets of about
        `bucket` elements, each with one more element per master: how many ranks had its
        gradient. A master none had one for keeps None (the optimizer skips it, as on one
        rank); one that only some had counts zeros for the others."""
        import torch.distributed as dist

        for masters in _buckets(self.params, bucket):
            flat = torch.cat(
                [m.grad.reshape(-1) if m.grad is not None else m.new_zeros(m.numel())
                 for m in masters]
                + [torch.tensor([float(m.grad is not None) for m in masters],
                                device=masters[0].device)]
            )  # fmt: skip
            dist.all_reduce(flat, group=group)
            *grads, had = flat.split([m.numel() for m in masters] + [len(masters)])
            for m, grad, ranks in zip(masters, grads, had.tolist(), strict=True):
                m.grad = grad.view_as(m) if ranks else None

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


def _buckets(params: list[torch.nn.Parameter], size: int) -> list[list[torch.nn.Parameter]]:
    """`params` in order, cut into runs of at most `size` elements (a larger one alone)."""
    out: list[list[torch.nn.Parameter]] = []
    count = size
    for p in params:
        if count + p.numel() > size:
            out.append([])
            count = 0
        out[-1].append(p)
        count += p.numel()
    return out
