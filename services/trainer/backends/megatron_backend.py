"""--train-backend megatron: the torch backend's training with megatron-core's GPTModel as the
actor (issue 15; one rank, tensor/pipeline/context parallel size 1 so far).

Everything but the actor is the torch backend's (torch_backend.py): the batching, the no-grad
forwards, the advantages and the loss code are shared, not copied; the reference and teacher
models stay Hugging Face models (forward only). The actor is built from the checkpoint's
config.json and weights (megatron_model.py) and trained with the same plain torch optimizer
(megatron's distributed optimizer is for GPUs). Its forward gets right-padded rows with
megatron's default causal mask (padding only follows a row's tokens, so it changes nothing
the loss reads), or, packed (--use-dynamic-batch-size), one row with a block-diagonal causal
mask built from the position ids. Weights leave in Hugging Face names and layouts
(`named_weights` for the weight sync, `save` for checkpoints), and `load_weights` reads them.

megatron needs a default process group and its parallel state: a bare trainer process gets a
one-rank gloo group (`_one_rank_group`); under torchrun it is torchrun's, and the ranks are
data parallel exactly as with the torch backend (distributed.py wraps the actor in DDP; to
megatron that is tensor and pipeline size 1, data parallel size = the world).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError

from . import megatron_model
from .torch_backend import TorchBackend


def _one_rank_group() -> None:
    """The default process group megatron's parallel state hangs on, for a bare process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, S, S] True where attention is masked, for one packed row whose position ids
    restart at 0 at each sample: causal, and never across samples."""
    sample_of = torch.cumsum((position_ids[0] == 0).long(), dim=0)
    S = sample_of.numel()
    future = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    other = sample_of[:, None] != sample_of[None, :]
    return (future | other)[None, None]


class MegatronBackend(TorchBackend):
    def __init__(
        self,
        cfg: RunConfig,
        actor_dir: str | Path,
        *,
        ref_dir: str | Path | None,
        total_steps: int,
        critic_dir: str | Path | None = None,
        teacher_dir: str | Path | None = None,
    ):
        if critic_dir is not None:
            raise MillstreamError(
                "--train-backend megatron has no critic yet: use --train-backend torch for ppo"
            )
        super().__init__(
            cfg, actor_dir, ref_dir=ref_dir, total_steps=total_steps, teacher_dir=teacher_dir
        )
        self.hf = self.model.requires_grad_(False)  # its config; the skeleton checkpoints use
        _one_rank_group()
        if not _PARALLEL_STATE:
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(1, 1)
            _PARALLEL_STATE.append(True)
        model = megatron_model.build(self.hf.config)
        self._load_megatron(model, self.hf.state_dict())
        self.model = self.train_model = model.train()
        self.make_actor_optimizer()

    def _load_megatron(self, model: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
        state = megatron_model.hf_to_megatron(hf_state, self.hf.config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise MillstreamError(
                f"the Megatron model does not match the checkpoint: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )

    def _logits(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if model is not self.model and model is not self.train_model:  # reference, teacher: HF
            return super()._logits(model, inputs)
        ids = inputs["input_ids"]
        if "position_ids" in inputs:  # packed: one row of several samples
            positions = inputs["position_ids"]
            return model(ids, positions, attention_mask=_block_causal_mask(positions))
        positions = torch.arange(ids.shape[1])[None].expand_as(ids)
        return model(ids, positions, attention_mask=None)

    def _hf_state(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return megatron_model.megatron_to_hf(state, self.hf.config)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in self._hf_state().items():
            yield name, value.detach()

    def save(
        self, directory: Path, save_optimizer: bool = True, *, actor_optimizer: bool = True
    ) -> None:
        # The base class writes `self.model` with `full_weights` as its state dict, and the
        # optimizer: here the Hugging Face skeleton with the Megatron weights in HF names.
        self.full_weights = {
            k: v.detach().contiguous().clone() for k, v in self._hf_state().items()
        }
        saved_model, self.model = self.model, self.hf
        try:
            super().save(directory, save_optimizer, actor_optimizer=actor_optimizer)
        finally:
            self.model, self.full_weights = saved_model, None

    def load_weights(self, directory: Path) -> None:
        from safetensors.torch import load_file

        self._load_megatron(self.model, load_file(str(directory / "model" / "model.safetensors")))


_PARALLEL_STATE: list[bool] = []  # megatron's parallel state is initialised once per process
