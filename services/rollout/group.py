"""The default rollout function: one group's n samples, all generated concurrently.

A fresh group starts with ONE `/generate` request carrying `n = n_samples` (SGLang's
parallel sampling): the engine batches the n sequences and the per-request overhead (router,
HTTP, JSON) is paid once per group instead of once per sample, which is most of the rollout
cost for short answers. Copy j is seeded sampling_seed + j by the engine. Whatever did not
finish there (aborted by a weight sync) continues as its own request and its own task, so a
long-tail sample never holds the others. A sample aborted by a weight sync parks the group in
the partial buffer, then:

  * with `--partial-rollout`, resumes from its tokens: input = prompt + response so far,
    max_new_tokens = what is left of the budget, the new part appended with its own logprobs
    and weight versions (`--mask-offpolicy-in-partial-rollout` masks the old part first);
  * without it, starts over from the prompt after the sync.

A sample aborted more than `max_aborts` times is published as aborted (the dynamic-sampling
filter `check_no_aborted` can drop it); the bound keeps a run whose engines never come back
from parking groups forever. A group carried back with `partial_samples` (re-queued by
someone) picks up where those samples stand: finished ones stay, aborted ones resume.

Infrastructure failures (GenerationFailed) cancel the group's other samples and propagate;
the worker publishes the group with the reason.

Known limit, shared with Miles: a stop string split across an abort is not seen by the
resumed request (its first part is in the prompt then).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from millstream.common.config import RunConfig
from millstream.common.types import PromptGroup, Sample, SampleGroup, SampleStatus

from .client import FRESH, GenerationFailed, RouterClient
from .config import GroupPlan, derive_seed, plan_for
from .generate import (
    add_rollout_metadata,
    append_answer,
    is_finished,
    mark_truncated,
    mask_prefix,
    new_sample,
    next_input_ids,
    reset_response,
)
from .partial import PartialBuffer

log = logging.getLogger("millstream.rollout")


class DefaultRollout:
    """`await DefaultRollout(buffer, ...)(group, cfg, client) -> SampleGroup`."""

    def __init__(
        self,
        buffer: PartialBuffer,
        *,
        partial: bool,
        mask_offpolicy: bool,
        max_aborts: int = 8,
    ):
        self.buffer = buffer
        self.partial = partial
        self.mask_offpolicy = mask_offpolicy
        self.max_aborts = max_aborts

    async def __call__(
        self, group: PromptGroup, cfg: RunConfig, client: RouterClient
    ) -> SampleGroup:
        if not group.prompt_token_ids:
            raise GenerationFailed(
                f"group {group.group_id!r} has no prompt_token_ids: the trainer tokenizes "
                "prompts before admission (the default rollout sends token ids only)",
                retryable=False,
            )
        plan = plan_for(group, cfg)
        samples = [new_sample(group, i) for i in range(plan.n_samples)]

        def snapshot() -> PromptGroup:
            view = PromptGroup()
            view.CopyFrom(group)
            view.ClearField("partial_samples")
            view.partial_samples.extend(samples)
            return view

        fresh = [s for s in samples if not is_finished(s) and not len(s.response_token_ids)]
        aborted: set[int] = set()
        if len(fresh) > 1:
            aborted = await self._parallel_first_round(group, fresh, plan, client)
        async with asyncio.TaskGroup() as tasks:
            for sample in samples:
                if not is_finished(sample):
                    after_abort = sample.index in aborted
                    tasks.create_task(
                        self._sample(group, sample, plan, client, snapshot, after_abort)
                    )
        result = SampleGroup(prompt=group, samples=samples)
        result.prompt.ClearField("partial_samples")  # they live on in `samples`
        return result

    async def _parallel_first_round(
        self, group: PromptGroup, fresh: list[Sample], plan: GroupPlan, client: RouterClient
    ) -> set[int]:
        """One request for all fresh samples; returns the indices that came back aborted,
        which `_sample` resumes as it would its own aborted request."""
        params = {
            **plan.sampling_params,
            "max_new_tokens": plan.max_new_tokens,
            "sampling_seed": derive_seed(plan.seed_key, fresh[0].index, 0),
            "n": len(fresh),
        }
        answers = await client.generate(
            list(group.prompt_token_ids), params, f"{group.group_id}-n{len(fresh)}"
        )
        aborted = set()
        for sample, answer in zip(fresh, answers, strict=True):
            append_answer(sample, answer, fallback_version=group.admitted_version)
            if sample.status == SampleStatus.SAMPLE_STATUS_ABORTED:
                aborted.add(sample.index)
            else:
                add_rollout_metadata(sample, requests=1, aborts=0, parallel=len(fresh))
        return aborted

    async def _sample(
        self,
        group: PromptGroup,
        sample: Sample,
        plan: GroupPlan,
        client: RouterClient,
        snapshot: Callable[[], PromptGroup],
        after_abort: bool = False,
    ) -> None:
        priority, aborts, requests = FRESH, 0, 0
        if after_abort:  # aborted in the parallel first round: that was request 0
            aborts = requests = 1
            priority = await self.buffer.wait(group.group_id, snapshot)
            self._prepare_resume(sample)
        elif len(sample.response_token_ids):  # carried in partial: this is a resume
            self._prepare_resume(sample)
        while True:
            done = len(sample.response_token_ids)
            if done >= plan.max_new_tokens:
                mark_truncated(sample)
                break
            params = {
                **plan.sampling_params,
                "max_new_tokens": plan.max_new_tokens - done,
                "sampling_seed": derive_seed(plan.seed_key, sample.index, done),
            }
            rid = f"{group.group_id}-s{sample.index}-r{requests}"
            answer = await client.generate(next_input_ids(sample), params, rid, priority=priority)
            requests += 1
            finish = append_answer(sample, answer, fallback_version=group.admitted_version)
            if finish != "abort":
                break
            aborts += 1
            if aborts > self.max_aborts:
                log.warning(
                    "sample %d of group %s aborted %d times; published as aborted",
                    sample.index,
                    group.group_id,
                    aborts,
                )
                break
            priority = await self.buffer.wait(group.group_id, snapshot)
            self._prepare_resume(sample)
        add_rollout_metadata(sample, requests=requests, aborts=aborts)

    def _prepare_resume(self, sample: Sample) -> None:
        if not self.partial:
            reset_response(sample)
        elif self.mask_offpolicy:
            mask_prefix(sample)
