"""SampleGroup in, exactly one ScoredGroup out: kept, filtered or failed, with a reason.

Owns the verdict of a group. The invariant: an infrastructure failure is never a reward.

* A group the rollout gave up on (`failure_reason` set), a group without samples, or one
  with a sample the rollout marked FAILED is passed through as FAILED, unscored (with the
  rollout's `plugin_error`, when a plugin failed it there, on the ScoredGroup).
* Every sample is scored concurrently (or the whole group at once with `--group-rm`;
  or, when every sample's reward is an instant rule such as `exact`, inline in one go). One
  attempt is bounded by `--reward-timeout` (per sample; a group reward gets it per sample of
  the group). An attempt that times out or fails on the infrastructure (a verifier that
  cannot be reached, a built-in rule's error) is retried `--reward-retries` times with a
  short exponential backoff (`reward_backoff`, common/retry.py); when the last attempt fails too, the other samples' work is
  cancelled and the WHOLE group is FAILED with a reason naming the sample and the error.
  No sample of a failed group carries a made-up reward.
* A plugin that raises or answers wrongly (the --custom-rm-path reward, a filter below) is
  a bug a retry repeats: the other samples' work is cancelled and the group is FAILED at
  once with the reason "reward: <flag> <path> raised <Type>: <message>" and `plugin_error`
  set (common/plugin_errors.py; the trainer prints its traceback and stops the run when it
  keeps happening).
* Otherwise rewards are filled in and, for training groups, the dynamic-sampling filter
  decides: KEPT, or FILTERED with the filter's reason. A kept training group then goes
  through the per-sample loss filter (--rollout-sample-filter-path), which can zero the loss
  masks of some of its samples.
* `timings["reward"]` holds the seconds this took.

The executor runs one attempt (inline: the Rewarder in this process; celery: a task on a
Celery worker); timeouts, retries and verdicts are the same for both. `stats` counts groups
by verdict and attempts that failed (raised, or a plugin's error), timed out and were retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from millstream.common import aio
from millstream.common.config import RunConfig
from millstream.common.plugin_errors import PluginFailed, find
from millstream.common.retry import Backoff, retrying
from millstream.common.types import Sample, SampleGroup, SampleStatus, ScoredGroup, Verdict
from millstream.compat.miles import make_args

from .filters import (
    FilterOutput,
    apply_filter,
    apply_sample_filter,
    resolve_filter,
    resolve_sample_filter,
)

log = logging.getLogger("millstream.reward")

_VERDICT_NAMES = {
    Verdict.VERDICT_KEPT: "kept",
    Verdict.VERDICT_FILTERED: "filtered",
    Verdict.VERDICT_FAILED: "failed",
}


def reward_backoff(retries: int) -> Backoff:
    """--reward-retries more attempts after the first, 0.1 s doubling to 2 s between them."""
    return Backoff(attempts=retries + 1, first_s=0.1, max_s=2.0)


class Executor(Protocol):
    async def sample_reward(self, sample: Sample, prompt: str) -> float: ...

    async def group_rewards(self, samples: Sequence[Sample], prompt: str = "") -> list[float]: ...

    async def aclose(self) -> None: ...


class RewardFailure(Exception):
    """A reward attempt failed every time it was tried; the message names what and why."""


class GroupScorer:
    def __init__(self, cfg: RunConfig, executor: Executor):
        self.cfg = cfg
        self.executor = executor
        self.timeout_s = cfg.reward.reward_timeout
        self.retries = cfg.reward.reward_retries
        path = cfg.rollout.dynamic_sampling_filter_path
        self.filter_path: str = path or ""
        self.filter = resolve_filter(path) if path else None
        self.sample_filter_path: str = cfg.rollout.rollout_sample_filter_path or ""
        self.sample_filter = (
            resolve_sample_filter(self.sample_filter_path) if self.sample_filter_path else None
        )
        self.args = make_args(cfg)
        self.stats: Counter[str] = Counter()

    async def score(self, group: SampleGroup) -> ScoredGroup:
        """The one terminal message for `group` (a copy; the input is not modified)."""
        started = time.monotonic()
        out = SampleGroup()
        out.CopyFrom(group)
        scored = ScoredGroup()
        try:
            verdict, reason = await self._judge(out)
        except PluginFailed as err:
            verdict, reason = Verdict.VERDICT_FAILED, err.reason
            scored.plugin_error.CopyFrom(err.error)
            self.stats["plugin_failed"] += 1
        if group.HasField("plugin_error"):  # failed by a plugin in rollout
            scored.plugin_error.CopyFrom(group.plugin_error)
        out.timings["reward"] = time.monotonic() - started
        self.stats[_VERDICT_NAMES[verdict]] += 1
        if verdict == Verdict.VERDICT_FAILED:
            log.warning("group %s failed: %s", group.prompt.group_id, reason)
        scored.group.CopyFrom(out)
        scored.verdict, scored.reason = verdict, reason
        return scored

    async def _judge(self, group: SampleGroup) -> tuple[int, str]:
        """(verdict, reason); PluginFailed when a plugin failed the group."""
        if group.failure_reason:
            return Verdict.VERDICT_FAILED, group.failure_reason
        if not group.samples:
            return Verdict.VERDICT_FAILED, "group has no samples to score"
        for s in group.samples:
            if s.status == SampleStatus.SAMPLE_STATUS_FAILED:
                why = s.failure_reason or "no reason given"
                return Verdict.VERDICT_FAILED, f"sample {s.index} failed in rollout: {why}"
        try:
            rewards = await self._rewards(group)
        except RewardFailure as err:
            return Verdict.VERDICT_FAILED, str(err)
        for sample, reward in zip(group.samples, rewards, strict=True):
            sample.reward = reward
        if group.prompt.is_eval:
            return Verdict.VERDICT_KEPT, ""
        if self.filter is not None:
            flag = "--dynamic-sampling-filter-path"
            try:
                decision = await apply_filter(self.filter, group, self.args)
            except Exception as err:
                raise PluginFailed.of(err, flag, self.filter_path, "reward") from err
            if not decision.keep:
                return _filter_verdict(decision)
        if self.sample_filter is not None:
            flag = "--rollout-sample-filter-path"
            try:
                removed = await apply_sample_filter(self.sample_filter, group, self.args)
            except Exception as err:
                raise PluginFailed.of(err, flag, self.sample_filter_path, "reward") from err
            self.stats["samples_removed"] += len(removed)
        return Verdict.VERDICT_KEPT, ""

    async def _rewards(self, group: SampleGroup) -> list[float]:
        prompt = group.prompt.prompt_text
        gid = group.prompt.group_id
        instant = getattr(self.executor, "instant_rewards", None)
        if instant is not None and not self.cfg.reward.group_rm:
            # Instant rules need neither a task, a timeout nor a retry per sample (which
            # cost more than the rule: 14 of 16 ms for a 128-sample step). One that raises
            # goes the usual way below, to be retried and reported as any attempt.
            try:
                rewards = instant(group.samples)
            except Exception:
                rewards = None
            if rewards is not None:
                return rewards
        if self.cfg.reward.group_rm:
            return await self._attempts(
                gid,
                "group reward",
                lambda: self.executor.group_rewards(group.samples, prompt),
                self.timeout_s * len(group.samples),
            )
        try:
            async with asyncio.TaskGroup() as tasks:
                jobs = [
                    tasks.create_task(
                        self._attempts(
                            gid,
                            f"sample {s.index}",
                            lambda s=s: self.executor.sample_reward(s, prompt),
                            self.timeout_s,
                        )
                    )
                    for s in group.samples
                ]
        except ExceptionGroup as errors:  # the first failure cancelled the other samples
            first = find(errors) or _first_reward_failure(errors)
            if first is None:
                raise
            raise first from None
        return [job.result() for job in jobs]

    async def _attempts(
        self, gid: str, what: str, attempt: Callable[[], Awaitable[Any]], timeout_s: float
    ) -> Any:
        tries = self.retries + 1
        try:
            async for retry in retrying(
                reward_backoff(self.retries),
                f"group {gid} {what}: reward",
                retry_on=lambda err: not isinstance(err, PluginFailed),
                logger=log,
                level=logging.INFO,
            ):
                with retry:
                    if retry.retry_state.attempt_number > 1:
                        self.stats["reward_retries"] += 1
                    return await self._attempt(attempt, timeout_s)
        except PluginFailed:
            raise  # a bug: another try repeats it
        except TimeoutError:
            error = f"timed out after {timeout_s:g} s (--reward-timeout)"
        except Exception as err:
            error = f"raised {type(err).__name__}: {err}"
        attempts = "1 attempt" if tries == 1 else f"{tries} attempts"
        raise RewardFailure(f"{what}: reward {error} ({attempts}, --reward-retries {self.retries})")

    async def _attempt(self, attempt: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        """One attempt, bounded and counted in `stats` when it fails."""
        try:
            # An executor that rides out Redis outages (celery) may take that much longer.
            outage_s = getattr(self.executor, "outage_s", 0.0)
            return await aio.wait_for(attempt(), timeout_s + outage_s)
        except PluginFailed:
            self.stats["reward_plugin_errors"] += 1
            raise
        except TimeoutError:
            self.stats["reward_timeouts"] += 1
            raise
        except Exception:
            self.stats["reward_errors"] += 1
            raise


def _first_reward_failure(errors: BaseExceptionGroup) -> RewardFailure | None:
    for err in errors.exceptions:
        found = _first_reward_failure(err) if isinstance(err, BaseExceptionGroup) else err
        if isinstance(found, RewardFailure):
            return found
    return None


def _filter_verdict(decision: FilterOutput) -> tuple[int, str]:
    if decision.keep:
        return Verdict.VERDICT_KEPT, ""
    return Verdict.VERDICT_FILTERED, decision.reason or "dropped by the dynamic-sampling filter"
