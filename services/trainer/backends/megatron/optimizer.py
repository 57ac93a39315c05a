"""--use-distributed-optimizer: megatron-core's own gradient buffers and distributed optimizer
for the Megatron backend's actor, on GPUs.

megatron's DistributedDataParallel keeps every gradient in one fp32 buffer (`main_grad`), and
`finalize_model_grads` reduce-scatters it over the data parallel ranks; its distributed
optimizer then gives each rank the Adam state of its slice of the buffer only, steps that
slice, and gathers the updated parameters back. The step is the plain one's:

- the gradients are summed over the ranks, not averaged (`calculate_per_token_loss`: each
  rank's loss is already divided by the whole step's samples or tokens, as the torch
  backend's is);
- every parameter gets --weight-decay, as the torch backend's AdamW gives it (megatron by
  default exempts biases and norms: `config_overrides={}` turns that off);
- SGD has no momentum, clipping is to --clip-grad over the whole gradient, and the learning
  rate follows optim.lr_factor (`Schedule`; torch's LambdaLR takes torch optimizers
  only).

On a CPU-only torch it cannot run: its optimizer makes its flags and buffers with literal
`device="cuda"` and checks parameters against `torch.cuda.FloatTensor` in a dozen places,
which is deeper than megatron/cpu.py's patches go; there the backend keeps the plain torch
optimizer, which takes the same step.

Checkpoints: `Optimizer.state_dict` is megatron's own state plus the parameter state gathered
to data parallel rank 0 (`get_parameter_state_dp_zero`), so it saves into the one optimizer
file the torch backend writes, and reads back into any number of data parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from millstream.common.config import RunConfig

from ..optim import lr_factor


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a GPTModel) under megatron's DistributedDataParallel, gradients summed."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model.config.calculate_per_token_loss = True  # sum over ranks (megatron: no 1/dp scaling)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, average_in_collective=False
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


class Optimizer:
    """megatron's optimizer with the interface the torch backend drives (`zero_grad`, `step`,
    `param_groups`, `state_dict`)."""

    def __init__(self, ddp: torch.nn.Module, cfg: RunConfig):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = cfg.optimizer
        config = OptimizerConfig(
            optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            sgd_momentum=0.0, clip_grad=o.clip_grad, use_distributed_optimizer=True,
            params_dtype=torch.float32,
        )  # fmt: skip
        self.ddp = ddp
        self.inner = get_megatron_optimizer(config, [ddp], config_overrides={})

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.ddp.zero_grad_buffer()
        self.inner.zero_grad(set_to_none)

    def step(self) -> float:
        """Reduce the gradients over the data parallel ranks, clip, step; the gradient norm
        before clipping."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])
        ok, grad_norm, _ = self.inner.step()
        if not ok:  # fp32 has no loss scale to skip a step over: a step not taken is a bug
            raise RuntimeError("megatron's optimizer skipped the step (inf or nan gradients)")
        if self.inner.config.clip_grad <= 0:
            # Without a clip a lone distributed optimizer's step reports 0; the step leaves
            # this step's gradients on its main parameters (they go at the next zero_grad).
            # Before the step they are not there yet (prepare_grads puts them there).
            grad_norm = self.inner.get_grad_norm()
        return float(grad_norm)

    def _parts(self) -> list[Any]:
        """The distributed optimizers inside (megatron chains one per kind of parameter)."""
        return list(getattr(self.inner, "chained_optimizers", [self.inner]))

    def state_dict(self) -> dict[str, Any]:
        """A collective of the data parallel ranks: every rank calls it, in the same place."""
        params = [part.get_parameter_state_dp_zero() for part in self._parts()]
        return {"megatron": self.inner.state_dict(), "params": params}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A collective likewise: data parallel rank 0's `state` is scattered to the others.
        Without grad: fp32 parameters are their own main copies, which it writes in place.
        megatron 0.16.1 with torch's Adam: `load_state_dict` puts the step count into each
        parameter's state, and the parameter state loader then looks for a saved "step"
        tensor that `get_parameter_state_dp_zero` never saves; set aside while it loads. It
        also gives every parameter the same step tensor, which Adam increments in place once
        per parameter: each gets its own copy back."""
        self.inner.load_state_dict(state["megatron"])
        with torch.no_grad():
            for part, params in zip(self._parts(), state["params"], strict=True):
                adam_state = part.optimizer.state
                steps = {p: s.pop("step") for p, s in adam_state.items() if "step" in s}
                part.load_parameter_state_from_dp_zero(params)
                for p, step in steps.items():
                    adam_state[p]["step"] = step.clone()


class Schedule:
    """optim.lr_factor's learning rate, set on megatron's parameter groups each step."""

    def __init__(self, optimizer: Optimizer, cfg: RunConfig, total_steps: int):
        self.optimizer, self.cfg, self.total_steps = optimizer, cfg, total_steps
        self.last_epoch = 0  # LambdaLR's name for the steps taken
        self._apply()

    def _apply(self) -> None:
        lr = self.cfg.optimizer.lr * lr_factor(self.last_epoch, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_epoch = int(state["last_epoch"])
        self._apply()
