"""Scored groups -> train samples: each sample's sequence-level reward, and the rollout's statistics.

Each kept group carries n scored samples of one prompt; the estimator's group stage
(`algorithms.advantages.group_rewards`) turns their rewards into the reward each sample's
token stage starts from (GRPO: normalised within the group). The token stage needs model
forwards (old, reference, critic, teacher) and runs in the backend. Failed samples never
reach here: a group with one is failed as a whole by the reward worker.
"""

from __future__ import annotations

import statistics

import torch

from millstream.common.config import RunConfig
from millstream.common.types import SampleStatus, ScoredGroup

from .algorithms.advantages import group_rewards
from .backends.base import TrainSample


def sample_rewards(groups: list[ScoredGroup], cfg: RunConfig) -> list[list[float]]:
    sizes = {len(g.group.samples) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"groups of unequal sizes {sorted(sizes)}: every group needs n_samples_per_prompt samples"
        )
    rewards_GN = torch.tensor(
        [[s.reward for s in g.group.samples] for g in groups], dtype=torch.float64
    )
    return group_rewards(rewards_GN, cfg.algo).tolist()


def build_samples(
    groups: list[ScoredGroup], version: int, cfg: RunConfig
) -> tuple[list[TrainSample], dict[str, float]]:
    rewards = sample_rewards(groups, cfg)
    samples: list[TrainSample] = []
    for group, reward_N in zip(groups, rewards, strict=True):
        for s, reward in zip(group.group.samples, reward_N, strict=True):
            behavior = min(s.weight_versions) if s.weight_versions else version
            samples.append(
                TrainSample(
                    tokens=list(s.prompt_token_ids) + list(s.response_token_ids),
                    prompt_len=len(s.prompt_token_ids),
                    loss_mask=list(s.loss_mask) or [1] * len(s.response_token_ids),
                    rollout_logprobs=list(s.rollout_logprobs),
                    reward=reward,
                    behavior_version=behavior,
                    version_lag=version - behavior,
                )
            )
    return samples, rollout_stats(groups, samples)


def rollout_stats(groups: list[ScoredGroup], samples: list[TrainSample]) -> dict[str, float]:
    flat = [s for g in groups for s in g.group.samples]
    lengths = [len(s.response_token_ids) for s in flat]
    lags = [t.version_lag for t in samples]
    return {
        "raw_reward": statistics.fmean(s.reward for s in flat),
        "response_len_mean": statistics.fmean(lengths),
        "response_len_max": max(lengths),
        "response_len_min": min(lengths),
        "truncated_ratio": sum(s.status == SampleStatus.SAMPLE_STATUS_TRUNCATED for s in flat)
        / len(flat),
        "staleness_mean": statistics.fmean(lags),
        "staleness_max": max(lags),
        "behavior_version_min": min(t.behavior_version for t in samples),
    }
