"""What a trainer backend takes and gives: samples in, metrics and weights out."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch


@dataclass(frozen=True)
class TrainSample:
    """One response to train on. Token lists are plain ints; the backend builds tensors."""

    tokens: list[int]  # prompt + response
    prompt_len: int
    loss_mask: list[int]  # one per response token
    rollout_logprobs: list[float]  # one per response token, from the engine
    # The sequence-level reward the estimator's token stage starts from (group-normalised for
    # grpo/gspo, minus the group mean for reinforce_plus_plus_baseline: algorithms.advantages).
    reward: float
    behavior_version: int = 0  # the policy version that sampled it (the oldest, if several)
    version_lag: int = 0  # policy version at training minus behavior_version
    teacher_logprobs: list[float] = field(default_factory=list)  # OPD from a teacher engine

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


class TrainBackend(Protocol):
    def train_rollout(
        self, samples: list[TrainSample], num_steps: int, rollout_id: int = 0
    ) -> dict[str, float]:
        """Run `num_steps` optimizer steps over the samples; return averaged metrics.
        `rollout_id` (0-based) lets PPO train only the critic for the first rollouts."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The actor's weights in Hugging Face naming, for the weight sync."""
        ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path, load_optimizer: bool) -> None: ...
