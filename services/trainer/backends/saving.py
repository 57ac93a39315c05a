"""What both backends write into a checkpoint directory and read back (loop.py `StepLoop` is
built on `Checkpoints`): the actor in Hugging Face format (model/: the torch backend's weights,
the gathered full ones when sharded, or the megatron backend's through its Hugging Face
skeleton, beside its torch_dist files), the actor's optimizer and schedule (OPTIMIZER_FILE,
with --bf16's fp32 masters; a file per rank, SHARD_FILE, where DataParallel saves them
sharded: backends/distributed.py), and PPO's critic with its own (CRITIC_DIR).

How a backend reads the actor's weights is its own (`load_weights`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from millstream.common.errors import MillstreamError

from .critic import ValueModel
from .precision import MasterWeights

OPTIMIZER_FILE = "optimizer.pt"
CRITIC_DIR = "critic"
SHARD_FILE = "optimizer.rank{rank}.pt"  # --train-backend fsdp: each rank's optimizer shard


def sharded_optimizer_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(SHARD_FILE.format(rank="*")))


class Checkpoints:
    """save and load; the state they read is the backend's (loop.py `StepLoop.__init__`)."""

    # Whether every data parallel rank takes part in a checkpoint's save (`save_shards`).
    collective_save = False

    model: Any  # a Hugging Face model: `save_pretrained`
    dtype: torch.dtype
    full_weights: dict[str, torch.Tensor] | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    master: MasterWeights | None
    critic: ValueModel | None
    critic_optimizer: torch.optim.Optimizer
    critic_scheduler: Any

    def save_shards(self, directory: Path, save_optimizer: bool = True) -> None:
        """What a rank other than 0 writes into a checkpoint, where the backend saves
        collectively (`collective_save`): nothing here."""

    def save(
        self, directory: Path, save_optimizer: bool = True, *, actor_optimizer: bool = True
    ) -> None:
        """The actor in Hugging Face format (the gathered full weights when sharded), its
        optimizer (`actor_optimizer=False`: the caller writes it, sharded), the critic."""
        self.model.save_pretrained(
            directory / "model", state_dict=self.full_weights, safe_serialization=True
        )
        if self.model.dtype != self.dtype:  # FSDP's --bf16: fp32 shards, bf16 weights gathered
            self.model.config.dtype = str(self.dtype).removeprefix("torch.")
            self.model.config.save_pretrained(directory / "model")
        if save_optimizer and actor_optimizer:
            state = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            if self.master is not None:  # --bf16: the fp32 weights model/ rounds
                state |= self.master.state_dict()
            torch.save(state, directory / OPTIMIZER_FILE)
        if self.critic is not None:
            critic_dir = directory / CRITIC_DIR
            self.critic.save(critic_dir)
            if save_optimizer:
                torch.save(
                    {
                        "optimizer": self.critic_optimizer.state_dict(),
                        "scheduler": self.critic_scheduler.state_dict(),
                    },
                    critic_dir / OPTIMIZER_FILE,
                )

    def load_weights(self, directory: Path) -> None:
        """The actor's weights from a checkpoint: each backend's own."""
        raise NotImplementedError

    def load(self, directory: Path, load_optimizer: bool = True, *, actor: bool = True) -> None:
        """A checkpoint's actor (`actor=False`: loaded already, and its optimizer is the
        caller's), its optimizer, the critic."""
        opt_path = directory / OPTIMIZER_FILE
        if actor:
            self.load_weights(directory)
            if load_optimizer and not opt_path.is_file() and sharded_optimizer_files(directory):
                n = len(sharded_optimizer_files(directory))
                raise MillstreamError(
                    f"{directory}: the optimizer state is sharded over {n} ranks (FSDP or "
                    "tensor parallel): resume with the same --train-backend and parallel sizes "
                    f"under torchrun --nproc-per-node {n}, or pass --no-load-optim"
                )
        if actor and load_optimizer and opt_path.is_file():
            state = load_state(opt_path)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if self.master is not None and "master" in state:
                self.master.load_state_dict(state)
        critic_dir = directory / CRITIC_DIR
        if self.critic is not None and critic_dir.is_dir():
            self.critic.load(critic_dir)
            opt_path = critic_dir / OPTIMIZER_FILE
            if load_optimizer and opt_path.is_file():
                state = load_state(opt_path)
                self.critic_optimizer.load_state_dict(state["optimizer"])
                self.critic_scheduler.load_state_dict(state["scheduler"])


def load_state(path: Path) -> dict:
    """An optimizer file (or one rank's shard), onto the host whatever device saved it:
    `load_state_dict` then puts each state where its parameter is. So a checkpoint a GPU
    wrote (its tensors say "cuda:0") resumes on the CPU, and each rank's state lands on its
    own device, where without a map_location every rank would load rank 0's file onto GPU 0
    first."""
    return torch.load(path, map_location="cpu", weights_only=True)
