"""Scored groups -> train samples: advantages per estimator, and the rollout's statistics.

Each kept group carries n scored samples of one prompt; the estimator turns their rewards
into one advantage per sample (GRPO: normalised within the group). Failed samples never reach
here: a group with one is failed as a whole by the reward worker.
"""

from __future__ import annotations

import statistics

import torch

from millstream.common.config import RunConfig
from millstream.common.types import SampleStatus, ScoredGroup

from .algorithms.advantages import grpo_advantages
from .backends.base import TrainSample


def advantages_for(groups: list[ScoredGroup], cfg: RunConfig) -> list[list[float]]:
    estimator = cfg.algo.advantage_estimator
    if estimator != "grpo":
        raise NotImplementedError(f"--advantage-estimator {estimator} is not built yet (grpo is)")
    sizes = {len(g.group.samples) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"groups of unequal sizes {sorted(sizes)}: every group needs n_samples_per_prompt samples"
        )
    rewards_GN = torch.tensor(
        [[s.reward for s in g.group.samples] for g in groups], dtype=torch.float64
    )
    adv_GN = grpo_advantages(rewards_GN, normalize_std=not cfg.algo.disable_grpo_std_normalization)
    return adv_GN.tolist()


def build_samples(
    groups: list[ScoredGroup], version: int, cfg: RunConfig
) -> tuple[list[TrainSample], dict[str, float]]:
    advantages = advantages_for(groups, cfg)
    samples: list[TrainSample] = []
    for group, adv_N in zip(groups, advantages, strict=True):
        for s, adv in zip(group.group.samples, adv_N, strict=True):
            lag = version - min(s.weight_versions) if s.weight_versions else 0
            samples.append(
                TrainSample(
                    tokens=list(s.prompt_token_ids) + list(s.response_token_ids),
                    prompt_len=len(s.prompt_token_ids),
                    loss_mask=list(s.loss_mask) or [1] * len(s.response_token_ids),
                    rollout_logprobs=list(s.rollout_logprobs),
                    advantage=adv,
                    version_lag=lag,
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
    }
