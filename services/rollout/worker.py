"""The rollout worker: {run}:prompts -> rollout function -> {run}:generated.

Owns one consumer in group `rollout` and runs the common StreamWorker over it. Each entry's
job decodes the PromptGroup, runs the rollout function (the default, or the user's
`--rollout-function-path` fn(group, cfg, client) -> SampleGroup: per group, millstream's own
form; Miles' whole-batch `generate_rollout(args, rollout_id, data_source, evaluation=False)`
is refused, see `check_rollout_function` and compat/miles/; or Miles' per-sample
`--custom-generate-function-path`, miles_generate.py) under a `rollout.group`
span continuing the entry's trace, and hands the SampleGroup off with `publish_and_ack`, which
carries the span's context on. Timings: `rollout` (seconds in the rollout function) and,
when the trainer stamped `admitted_unix`, `rollout_queue` (admission to the worker's start).

Invariant: every PromptGroup entry yields exactly one SampleGroup on {run}:generated: the
samples, or the group with `failure_reason` when the router could not generate (never a zero
reward: the reward worker passes it through as failed), or when a plugin (the rollout or
generate function, the buffer filter) raised or returned a wrong value: then at once, with
`plugin_error` set and never retried (common/plugin_errors.py; the trainer prints the
traceback and stops the run when it keeps happening). Other errors (millstream's own bugs)
leave the entry pending for redelivery and, past --max-deliveries, the dead stream. A Redis
outage shorter than --redis-outage-timeout only delays the hand-off (common/worker.py).

Group slots: the StreamWorker runs up to `--rollout-max-concurrency` groups at once, as many
as there are generation slots, so a group waiting on its long-tail sample (or parked for a
sync) never keeps a free slot unused; the slots in the client bound what reaches the router.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from opentelemetry.trace import SpanKind

from millstream.common import telemetry
from millstream.common.config import RunConfig
from millstream.common.keys import GROUP_ROLLOUT, RunKeys
from millstream.common.plugin_errors import PluginFailed, error_key, find, reraise
from millstream.common.streams import Consumer, StreamEntry, decode
from millstream.common.telemetry import context_from_fields, inject_fields, tracer
from millstream.common.types import PromptGroup, SampleGroup
from millstream.common.worker import StreamWorker
from millstream.compat.miles import (
    check_not_old_signature,
    check_rollout_function,
    make_args,
)
from millstream.compat.plugins import load_function

from .client import GenerationFailed, RouterClient
from .group import DefaultRollout
from .miles_generate import MilesGenerate
from .partial import BufferFilter, PartialBuffer, pop_first
from .prom import RolloutMetrics

log = logging.getLogger("millstream.rollout")

RolloutFn = Callable[[PromptGroup, RunConfig, RouterClient], Awaitable[SampleGroup]]
HEARTBEAT_TTL_S = 15


def first_failure(err: BaseException) -> GenerationFailed | None:
    """The GenerationFailed inside `err` (itself, or in an exception group), if any."""
    if isinstance(err, GenerationFailed):
        return err
    if isinstance(err, BaseExceptionGroup):
        for inner in err.exceptions:
            found = first_failure(inner)
            if found is not None:
                return found
    return None


def load_rollout_function(path: str) -> RolloutFn:
    fn = load_function(path, "--rollout-function-path")
    check_rollout_function(fn, path)
    return fn


def load_buffer_filter(path: str) -> BufferFilter:
    """Miles' buffer filter at `path`; PluginFailed when it raises or returns anything but
    lists of the buffer's groups (partial.py `resume_order` reads them)."""
    flag = "--buffer-filter-path"
    fn = load_function(path, flag)
    check_not_old_signature(fn, flag, path)

    def checked(args: Any, rollout_id: int | None, buffer: list, num_samples: int) -> list:
        lists = {id(samples) for samples in buffer}
        gids = {s.group_id for samples in buffer for s in samples}
        try:
            out = fn(args, rollout_id, buffer, num_samples)
        except Exception as err:
            reraise(err, flag, path, "rollout")
        if out is None:  # none chosen: all resume FIFO
            return []
        for samples in out if isinstance(out, list) else [None]:
            if not isinstance(samples, list) or (
                id(samples) not in lists and not (samples and samples[0].group_id in gids)
            ):
                wrong = TypeError(
                    f"returned {_shown(out)}: expected a list of the buffer's lists of Samples"
                )
                raise PluginFailed.of(wrong, flag, path, "rollout")
        return out

    return checked


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def failed_group(group: PromptGroup, reason: str) -> SampleGroup:
    return SampleGroup(prompt=group, failure_reason=reason)


class RolloutWorker:
    def __init__(
        self,
        cfg: RunConfig,
        redis: aioredis.Redis,
        client: RouterClient,
        consumer_name: str,
        *,
        partial_poll_s: float = 0.5,
        partial_max_wait_s: float = 5.0,
    ):
        r = cfg.rollout
        self.cfg = cfg
        self.client = client
        self.keys = RunKeys(cfg.run_id)
        buffer_filter: BufferFilter = pop_first
        if r.buffer_filter_path:
            buffer_filter = load_buffer_filter(r.buffer_filter_path)
        self.buffer = PartialBuffer(
            client,
            buffer_filter,
            args=make_args(cfg),
            poll_s=partial_poll_s,
            max_wait_s=partial_max_wait_s,
        )
        client.on_answer = self.buffer.engines_answered
        self.rollout_fn: RolloutFn = DefaultRollout(
            self.buffer,
            partial=r.partial_rollout,
            mask_offpolicy=r.mask_offpolicy_in_partial_rollout,
        )
        if r.rollout_function_path:
            self.rollout_fn = load_rollout_function(r.rollout_function_path)
        elif r.custom_generate_function_path:  # Miles' per-sample generate
            self.rollout_fn = MilesGenerate(
                r.custom_generate_function_path, cfg, client.url, self.buffer
            )
        self.consumer = Consumer.for_run(
            redis, cfg, self.keys.prompts, GROUP_ROLLOUT, consumer_name
        )
        # This process's Redis outages: told under the worker's name, ridden out that long.
        self.consumer.outages.configure(
            who=consumer_name, timeout_s=cfg.service.redis_outage_timeout
        )
        self.stream_worker = StreamWorker(
            self.consumer,
            self.handle,
            concurrency=r.rollout_max_concurrency,
            name=f"rollout[{consumer_name}]",
            heartbeat=(redis, self.keys.heartbeat("rollout", consumer_name), HEARTBEAT_TTL_S),
            on_stop=client.stop,  # a drain does not wait out retries against a gone router
        )
        self.failed_groups = 0
        self._plugin_errors_seen: set[tuple[str, ...]] = set()
        self._tracer = tracer("millstream.rollout")
        self.metrics = RolloutMetrics(self)  # served by main.py with --metrics-port

    async def run(self) -> None:
        """Consume until `stop()` (or SIGTERM after `install_signal_handlers`), then drain."""
        releaser = asyncio.create_task(self.buffer.run(), name="rollout:partial-buffer")
        try:
            await self.stream_worker.run()
        finally:
            releaser.cancel()
            await asyncio.gather(releaser, return_exceptions=True)

    def stop(self) -> None:
        self.stream_worker.stop()

    async def handle(self, entry: StreamEntry) -> None:
        group = decode(entry, PromptGroup)
        parent = context_from_fields(entry.trace_fields)
        ids = {telemetry.GROUP_ID: group.group_id}
        queued_ns = telemetry.entry_time_ns(entry.id)
        telemetry.wait_span(self._tracer, entry.stream, "prompts_wait", queued_ns, parent, ids)
        attributes = {
            telemetry.STAGE: "rollout",
            **ids,
            "millstream.n_samples": group.n_samples,
            **telemetry.process_attributes(entry.stream, entry.id, GROUP_ROLLOUT),
        }
        with self._tracer.start_as_current_span(
            f"process {entry.stream}", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        ) as span:
            # Wall clocks of two machines: good to a clock skew, so never below 0.
            queued_s = max(0.0, time.time() - group.admitted_unix) if group.admitted_unix else 0.0
            start = time.monotonic()
            result = await self.rollout(group)
            result.timings["rollout"] = time.monotonic() - start
            if group.admitted_unix:
                result.timings["rollout_queue"] = queued_s
            if result.failure_reason:
                span.set_attribute("millstream.failure_reason", result.failure_reason)
            # The hand-off carries this span's context: the reward's wait span, which starts
            # at the entry's XADD, is its child (no span of its own for the XADD: spans are
            # most of a worker's CPU per group).
            fields = inject_fields()
        self.metrics.observe(result.timings)
        handed_off = await self.consumer.publish_and_ack(self.keys.generated, result, fields, entry)
        if handed_off is None:
            log.info("group %s was taken over and handed off by another worker", group.group_id)

    async def rollout(self, group: PromptGroup) -> SampleGroup:
        """The rollout function's SampleGroup, or the group failed: with the router's reason,
        or with the plugin's error (module docstring)."""
        try:
            result = await self._run_rollout_fn(group)
        except Exception as err:
            plugin = find(err)
            if plugin is not None:
                return self._plugin_failed(group, plugin)
            failure = first_failure(err)
            if failure is None:
                raise
            self.failed_groups += 1
            log.error("group %s failed: %s", group.group_id, failure)
            return failed_group(group, f"rollout: {failure}")
        if not result.HasField("prompt"):
            result.prompt.CopyFrom(group)
        return result

    async def _run_rollout_fn(self, group: PromptGroup) -> SampleGroup:
        """The rollout function's answer; a --rollout-function-path's error or wrong answer
        as a PluginFailed (the others' plugins raise theirs themselves)."""
        path = self.cfg.rollout.rollout_function_path
        flag = "--rollout-function-path"
        try:
            result = self.rollout_fn(group, self.cfg, self.client)
            if inspect.isawaitable(result):  # a plain function is fine too
                result = await result
        except Exception as err:
            if not path or find(err) is not None:
                raise
            reraise(err, flag, path, "rollout")
        if not isinstance(result, SampleGroup):
            wrong = TypeError(
                f"the rollout function returned {type(result).__name__} for group "
                f"{group.group_id!r}; it must return a millstream.common.types.SampleGroup"
            )
            if not path:
                raise wrong
            raise PluginFailed.of(wrong, flag, path, "rollout")
        return result

    def _plugin_failed(self, group: PromptGroup, plugin: PluginFailed) -> SampleGroup:
        self.failed_groups += 1
        error = plugin.error
        seen = self._plugin_errors_seen
        if error_key(error) not in seen and len(seen) < 256:  # its traceback once, in our log
            seen.add(error_key(error))
            log.error("group %s failed: %s\n%s", group.group_id, plugin.reason, error.traceback)
        else:
            log.error("group %s failed: %s", group.group_id, plugin.reason)
        failed = failed_group(group, plugin.reason)
        failed.plugin_error.CopyFrom(error)
        return failed
