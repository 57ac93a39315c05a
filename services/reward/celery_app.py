"""Reward scoring on Celery workers (`--reward-executor celery`, `millstream reward-celery`).

For heavy verifiers (code execution, big sympy jobs) that should not share a process with the
stream consumer. The run's own Redis is both broker and result backend; every Celery key is
prefixed `{run}:celery:` (kombu's and the result backend's `global_keyprefix`) and the queue is
`millstream.reward.{run}`, so runs sharing a Redis never see each other's tasks.

Wire format: JSON only (`accept_content=["json"]`, no pickle, docs/architecture.md). A task
takes one JSON string: `{"run_id", "prompt", "sample": base64 protobuf Sample}` for
`score_sample`, `{"run_id", "samples": [...]}` for `score_group`; it returns the float
reward(s), or, when the --custom-rm-path function failed (a PluginFailed), `{"plugin_error":
{...}}`, which the reward worker raises again as that PluginFailed, traceback included: the
group fails at once, as with inline scoring (common/plugin_errors.py). A Celery worker is
started with only --redis-url and --run-id and builds the same `Rewarder` from the run config
in Redis, so the rewards are the same as inline scoring. A task for another run id is refused.

The reward worker sends tasks and waits for results (`CeleryExecutor`); timeouts and retries
of a reward stay in its scorer. A Redis outage is not a failed reward: as every other Redis
client of millstream (common/redis_conn.py), the executor rides it out for up to
--redis-outage-timeout, sending the task again once Redis answers (common/retry.py; a reward
is safe to compute twice), and the scorer's bound on an attempt grows by that much
(`outage_s`); Celery's own wait for the result stays bounded by --reward-timeout. `make_celery_app` builds an app without touching the broker, so importing
this module or building the app has no side effects.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

from opentelemetry.trace import SpanKind

from millstream.common import aio, telemetry
from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError
from millstream.common.plugin_errors import PluginFailed
from millstream.common.redis_conn import OUTAGE_TIMEOUT_S, password_for
from millstream.common.retry import Backoff, retrying
from millstream.common.types import Sample

from .rewarder import Rewarder, ThreadRunner

TASK_SAMPLE = "millstream.reward.score_sample"
TASK_GROUP = "millstream.reward.score_group"
T = TypeVar("T")


def queue_name(run_id: str) -> str:
    return f"millstream.reward.{run_id}"


def _url_with_password(url: str, password: str | None) -> str:
    """`url` with the password every Redis client uses (`password_for`) written in."""
    password = password_for(url, password)
    if not password:
        return url
    parts = urlsplit(url)
    netloc = f"{parts.username or ''}:{quote(password, safe='')}@{parts.hostname}" + (
        f":{parts.port}" if parts.port else ""
    )
    return urlunsplit(parts._replace(netloc=netloc))


def make_celery_app(redis_url: str, run_id: str, password: str | None = None) -> Any:
    """A Celery app for one run (nothing connects until a task is sent or a worker starts)."""
    try:
        from celery import Celery
    except ImportError as err:
        raise MillstreamError(
            f"--reward-executor celery needs Celery ({err}): `pip install millstream[reward]`"
        ) from err

    url = _url_with_password(redis_url, password)
    prefix = {"global_keyprefix": f"{run_id}:celery:"}
    app = Celery(f"millstream-reward-{run_id}", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_default_queue=queue_name(run_id),
        broker_transport_options=prefix,
        result_backend_transport_options=prefix,
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
    )
    return app


def encode_sample(sample: Sample) -> str:
    return base64.b64encode(sample.SerializeToString()).decode("ascii")


def decode_sample(text: str) -> Sample:
    return Sample.FromString(base64.b64decode(text))


class CeleryRuntime:
    """The Celery worker's side: one event loop thread running the run's Rewarder."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="reward-loop", daemon=True
        )
        self._thread.start()
        self.rewarder = Rewarder(cfg, service="reward-celery")

    def run(self, coro: Coroutine[Any, Any, T], samples: int = 1) -> T | dict[str, Any]:
        """The coroutine's result, or a PluginFailed's JSON (the module docstring)."""
        # The Celery worker bounds each attempt too (by --reward-timeout per sample, as the
        # scorer does), so a hung async reward frees its worker thread.
        bounded = aio.wait_for(coro, self.cfg.reward.reward_timeout * samples)
        try:
            return asyncio.run_coroutine_threadsafe(bounded, self.loop).result()
        except PluginFailed as err:
            return err.to_json()

    def check_run(self, payload: dict[str, Any]) -> None:
        if payload.get("run_id") != self.cfg.run_id:
            raise ValueError(
                f"task for run {payload.get('run_id')!r} reached the Celery worker of run "
                f"{self.cfg.run_id!r}: start one `millstream reward-celery` per run"
            )

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.rewarder.aclose(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


def register_tasks(app: Any, runtime: CeleryRuntime) -> None:
    """The reward tasks, bound to this worker's runtime."""

    @app.task(name=TASK_SAMPLE)
    def score_sample(payload_json: str) -> float | dict[str, Any]:
        payload = json.loads(payload_json)
        runtime.check_run(payload)
        sample = decode_sample(payload["sample"])
        with _task_span(TASK_SAMPLE, payload, 1):
            return runtime.run(runtime.rewarder.sample_reward(sample, payload.get("prompt", "")))

    @app.task(name=TASK_GROUP)
    def score_group(payload_json: str) -> list[float] | dict[str, Any]:
        payload = json.loads(payload_json)
        runtime.check_run(payload)
        samples = [decode_sample(text) for text in payload["samples"]]
        with _task_span(TASK_GROUP, payload, len(samples)):
            prompt = payload.get("prompt", "")
            return runtime.run(runtime.rewarder.group_rewards(samples, prompt), len(samples))


def _task_span(task: str, payload: dict[str, Any], samples: int) -> Any:
    """The Celery task's span, a child of the reward worker's `reward.score` span: the trace
    context rides in the task's JSON payload (`traceparent`/`tracestate`)."""
    queue = queue_name(payload["run_id"])
    return telemetry.tracer("millstream.reward").start_as_current_span(
        f"process {queue}",
        context=telemetry.context_from_fields(payload),
        kind=SpanKind.CONSUMER,
        attributes={
            telemetry.STAGE: "reward_task",
            "millstream.samples": samples,
            **telemetry.messaging_attributes(queue, "process", **{"celery.task.name": task}),
        },
    )


def _outage(err: BaseException) -> bool:
    """Redis unreachable, as kombu (publishing) or redis-py (the result backend) says it."""
    from kombu.exceptions import OperationalError
    from redis.exceptions import ConnectionError as RedisDown
    from redis.exceptions import TimeoutError as RedisSlow

    # Not any OSError: a reward function's own error comes back through result.get too.
    return isinstance(err, OperationalError | RedisDown | RedisSlow)


class CeleryExecutor:
    """The reward worker's side: one task per attempt, its result awaited without blocking."""

    # The result wait outlives the scorer's timeout a little, so a late answer is still
    # collected (and its pubsub subscription dropped) instead of leaking.
    _GRACE_S = 1.0

    def __init__(
        self,
        app: Any,
        run_id: str,
        timeout_s: float,
        max_waiting: int = 256,
        outage_s: float = OUTAGE_TIMEOUT_S,
    ):
        self.app = app
        self.run_id = run_id
        self.timeout_s = timeout_s
        self.queue = queue_name(run_id)
        self.threads = ThreadRunner(max_waiting)
        self.outage_s = outage_s  # read by the scorer: an attempt may wait this long for Redis
        self._outage = Backoff(within_s=outage_s, first_s=0.1, max_s=2.0)

    async def sample_reward(self, sample: Sample, prompt: str) -> float:
        payload = {"run_id": self.run_id, "prompt": prompt, "sample": encode_sample(sample)}
        return float(await self._call(TASK_SAMPLE, payload, self.timeout_s))

    async def group_rewards(self, samples: Sequence[Sample], prompt: str = "") -> list[float]:
        payload = {
            "run_id": self.run_id,
            "prompt": prompt,
            "samples": [encode_sample(s) for s in samples],
        }
        values = await self._call(TASK_GROUP, payload, self.timeout_s * len(samples))
        return [float(v) for v in values]

    async def _call(self, task: str, payload: dict[str, Any], timeout_s: float) -> Any:
        telemetry.inject_fields(payload)  # the task's span continues the caller's trace
        body = json.dumps(payload)
        async for attempt in retrying(
            self._outage, f"Celery task {task}: Redis unreachable", retry_on=_outage
        ):
            with attempt:
                return await self.threads.run(self._send_and_wait, task, body, timeout_s)
        raise AssertionError("unreachable: retrying raises the last error")

    def _send_and_wait(self, task: str, payload_json: str, timeout_s: float) -> Any:
        from celery.exceptions import TimeoutError as CeleryTimeout

        result = self.app.send_task(task, args=[payload_json], queue=self.queue)
        try:
            value = result.get(timeout=timeout_s + self._GRACE_S, interval=0.05)
        except CeleryTimeout:
            raise TimeoutError(f"no Celery worker answered {task} within {timeout_s:g} s") from None
        finally:
            with contextlib.suppress(Exception):  # tidying only: the answer (or error) matters
                result.forget()
        failed = PluginFailed.from_json(value)
        if failed is not None:
            raise failed
        return value

    async def aclose(self) -> None:
        await asyncio.to_thread(self.app.close)
