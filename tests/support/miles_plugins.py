"""Plugins written exactly as Miles' docs show them (docs/user-guide/customization.md), with
only the imports changed to millstream's (`miles.utils.types.Sample` ->
`millstream.common.miles.Sample`, likewise DynamicFilterOutput):

--custom-rm-path tests.support.miles_plugins.custom_rm
--custom-rm-path tests.support.miles_plugins.batched_custom_rm   (with --group-rm)
--dynamic-sampling-filter-path tests.support.miles_plugins.filter_function
--buffer-filter-path tests.support.miles_plugins.buffer_filter

Each reads what Miles gives it (args' flags, the Sample's fields) so a test sees that the
values arrived; the buffer filter prints a line the test finds in the worker's log.
"""

from __future__ import annotations

import asyncio
import sys

from millstream.common.miles import DynamicFilterOutput, Sample


async def custom_rm(args, sample: Sample) -> float:
    """1 when the response equals the label; the metadata can ask for a bonus, and the prompt
    and Miles' args must be there."""
    await asyncio.sleep(0)
    assert sample.reward is None, "the reward is not known yet"
    assert isinstance(sample.prompt, str) and sample.prompt, "the group's prompt"
    assert args.rollout_batch_size >= 1 and args.custom_rm_path.endswith("custom_rm")
    if sample.status == Sample.Status.ABORTED:
        return 0.0
    reward = 1.0 if sample.response.strip() == (sample.label or "").strip() else 0.0
    return reward + float(sample.metadata.get("bonus", 0.0))


async def batched_custom_rm(args, samples: list[Sample]) -> list[float]:
    """Batched mode (--group-rm): 1 for the longest response text of the group, else 0."""
    assert args.group_rm
    longest = max(range(len(samples)), key=lambda i: (len(samples[i].response), -i))
    return [1.0 if i == longest else 0.0 for i in range(len(samples))]


def filter_function(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep a group only when its rewards differ (DAPO), with Miles' reason naming."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    if len(set(rewards)) > 1:
        return DynamicFilterOutput(keep=True, reason=None)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")


def buffer_filter(
    args,
    rollout_id: int | None,
    buffer: list[list[Sample]],
    num_samples: int,
) -> list[list[Sample]]:
    """Pop the groups with the most generated tokens first (Miles' pop_first, reordered)."""
    buffer.sort(key=lambda group: -sum(s.response_length for s in group))
    num_to_pop = min(len(buffer), num_samples)
    samples = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    tokens = [sum(s.response_length for s in group) for group in samples]
    print(
        f"miles buffer_filter: rollout_id={rollout_id} popped {len(samples)} of {num_samples} "
        f"(tokens {tokens}, partial_rollout={args.partial_rollout})",
        file=sys.stderr,
        flush=True,
    )
    return samples
