"""User plugins for the rollout worker's tests, loaded by path from the run config.

--rollout-function-path tests.support.rollout_plugins.two_turn
--buffer-filter-path tests.support.rollout_plugins.longest_first
"""

from __future__ import annotations

import asyncio

from millstream.common.config import RunConfig
from millstream.common.types import PromptGroup, Sample, SampleGroup
from millstream.compat.miles import Sample as MilesSample
from millstream.rollout.client import RouterClient
from millstream.rollout.config import plan_for
from millstream.rollout.generate import append_answer, append_tokens, new_sample, next_input_ids

USER_TURN_TEXT = "[user: go on]"


async def two_turn(group: PromptGroup, cfg: RunConfig, client: RouterClient) -> SampleGroup:
    """Two policy turns per sample with a user turn between them. The user turn reuses the
    prompt's first tokens as its ids, so they are valid for any tokenizer; it is masked out of
    the loss. Each turn gets half the response budget."""
    plan = plan_for(group, cfg)
    params = {**plan.sampling_params, "max_new_tokens": max(1, plan.max_new_tokens // 2)}
    user_turn = list(group.prompt_token_ids[:3])

    async def one(index: int) -> Sample:
        sample = new_sample(group, index)
        for turn in range(2):
            if turn:
                version = (sample.weight_versions or [group.admitted_version])[-1]
                append_tokens(sample, user_turn, USER_TURN_TEXT, version=version)
            answer = await client.generate(
                next_input_ids(sample), params, f"{group.group_id}-{index}-t{turn}"
            )
            append_answer(sample, answer, fallback_version=group.admitted_version)
        return sample

    samples = await asyncio.gather(*(one(i) for i in range(plan.n_samples)))
    return SampleGroup(prompt=group, samples=samples)


def longest_first(args, rollout_id, buffer: list[list[MilesSample]], num_samples: int):
    """Miles' buffer filter signature: resume the groups with the most generated tokens first
    (they waste most if dropped)."""
    return sorted(buffer, key=lambda group: -sum(s.response_length for s in group))[:num_samples]


def drops_all(args, rollout_id, buffer: list[list[MilesSample]], num_samples: int):
    """A buffer filter that returns nothing: the buffer must still resume every group."""
    return []


def miles_generate_rollout(args, rollout_id, data_source, evaluation=False):
    """Miles' whole-batch rollout function: refused here."""
    raise AssertionError("never called")


def returns_the_prompt(group: PromptGroup, cfg: RunConfig, client: RouterClient) -> PromptGroup:
    """A broken rollout function: returns its input instead of a SampleGroup."""
    return group
