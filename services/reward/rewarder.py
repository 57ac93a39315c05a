"""One attempt at a reward: which function runs for a sample, and how it runs.

The reward of a sample comes from, in order: `--custom-rm-path` (your `fn(args, sample)`, or
with `--group-rm` your `fn(args, samples) -> list`, Miles' signatures: compat/miles/), the
sample's metadata `rm_type`, then `--rm-type`. Functions may be sync or async and may return a
number or a dict (`to_reward` reads `--reward-key`). `args` is Miles' read-only namespace of
the run's flags, `sample` Miles' `Sample` (converted from the wire message here, with the
group's prompt and `reward` None). An error your function raises, or an answer that is no
reward (NaN, a string, a list of the wrong length), is a PluginFailed naming its path with
the traceback (common/plugin_errors.py): the scorer fails the group at once, without a retry.
A connection or HTTP error, or a timeout, is the verifier's and is retried.

Sync code (your sync function, the math built-ins, which may sit in sympy for a long time) runs
in a daemon thread per call, at most `max_threads` at once (`exact` and `f1`, plain string
work, run inline), so the event loop keeps serving other groups and a hung verifier can neither
block the process from exiting nor be waited for past `--reward-timeout`: the scorer stops
waiting, and the thread is abandoned, keeping its slot until it returns (`ThreadRunner.alive`
counts live threads). A thread pool would not do: its threads are joined at exit, so one hung
verifier would block shutdown. Timeouts and retries live in the scorer, around an attempt,
identically for every executor; this module only runs one attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError
from millstream.common.plugin_errors import PluginFailed, reraise
from millstream.common.types import Sample
from millstream.compat.miles import (
    check_not_old_signature,
    is_async,
    make_args,
    samples_from_pb,
)
from millstream.compat.plugins import load_function

from .math_utils import last_boxed
from .remote_rm import RemoteRM
from .rm_hub import (
    INSTANT_RULES,
    REMOTE,
    check_tokenizer,
    sample_rule_reward,
    split_rm_type,
    to_reward,
)

T = TypeVar("T")


def check_reward_config(cfg: RunConfig) -> None:
    """Fail at start-up, not on the first sample, on a reward config that cannot work: the
    flags, and the tokenizer an `exact` --rm-type reads (rm_hub.check_tokenizer). Loads no
    user code (a Celery-backed reward worker need not import it)."""
    r = cfg.reward
    if r.group_rm and not r.custom_rm_path:
        raise MillstreamError("--group-rm scores with your function: set --custom-rm-path too")
    if r.rm_type:
        split_rm_type(r.rm_type)
    check_tokenizer(cfg)


class ThreadRunner:
    """Runs a sync callable in its own daemon thread; at most `max_threads` at once."""

    def __init__(self, max_threads: int):
        self.max_threads = max_threads
        self._slots: asyncio.Semaphore | None = None
        self._lock = threading.Lock()
        self.alive = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_threads)
        slots = self._slots
        await slots.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, err: BaseException | None) -> None:
            slots.release()
            if done.cancelled():
                return
            if err is not None:
                done.set_exception(err)
            else:
                done.set_result(result)

        def body() -> None:
            with self._lock:
                self.alive += 1
            try:
                result, err = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine, not swallowed
                result, err = None, exc
            finally:
                with self._lock:
                    self.alive -= 1
            # A closed loop (RuntimeError) means nobody is waiting for this answer any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, err)

        threading.Thread(target=body, name="reward-fn", daemon=True).start()
        return await done


class Rewarder:
    """Computes raw rewards for one run config; see the module docstring."""

    def __init__(self, cfg: RunConfig, *, max_threads: int = 32, service: str = "reward"):
        check_reward_config(cfg)
        r = cfg.reward
        self.cfg = cfg
        self.service = service  # where a plugin error says it raised
        self.reward_key = r.reward_key
        self.group_rm = r.group_rm
        self.custom_path: str = r.custom_rm_path or ""
        self.custom = (
            load_function(r.custom_rm_path, "--custom-rm-path") if r.custom_rm_path else None
        )
        if self.custom is not None:
            flag = "--custom-rm-path --group-rm" if r.group_rm else "--custom-rm-path"
            check_not_old_signature(self.custom, flag, r.custom_rm_path)
        self.args = make_args(cfg)
        self.remote = RemoteRM(r.rm_url, r.reward_timeout) if r.rm_url else None
        self.threads = ThreadRunner(max_threads)

    async def sample_reward(self, sample: Sample, prompt: str) -> float:
        """One attempt at one sample's reward."""
        if self.custom is not None:
            (miles_sample,) = samples_from_pb([sample], prompt)
            value = await self._custom(miles_sample)
            return self._custom_reward(value)
        rm_type = self._rm_type(sample)
        boxed, base = split_rm_type(rm_type)
        if base == REMOTE:
            if self.remote is None:
                raise MillstreamError(f"rm_type {rm_type!r} needs --rm-url in the run config")
            response = sample.response_text
            if boxed:
                response = last_boxed(response) or ""
            value = await self.remote(sample, prompt, response)
            return to_reward(value, self.reward_key)
        if base in INSTANT_RULES:
            value = sample_rule_reward(rm_type, sample, self.cfg)
        else:
            value = await self.threads.run(sample_rule_reward, rm_type, sample, self.cfg)
        return to_reward(value, self.reward_key)

    def instant_rewards(self, samples: Sequence[Sample]) -> list[float] | None:
        """Every sample's reward when each comes from an instant rule (`exact`, `f1`: plain
        string work), computed right here; None when any sample needs more (your function,
        a remote RM, a math verifier in its thread), which then goes the usual way."""
        if self.custom is not None:
            return None
        rm_types = [self._rm_type(s) for s in samples]
        if any(split_rm_type(t)[1] not in INSTANT_RULES for t in rm_types):
            return None
        return [
            to_reward(sample_rule_reward(t, s, self.cfg), self.reward_key)
            for t, s in zip(rm_types, samples, strict=True)
        ]

    async def group_rewards(self, samples: Sequence[Sample], prompt: str = "") -> list[float]:
        """One attempt at a whole group's rewards with the `--group-rm` function."""
        assert self.custom is not None
        values = await self._custom(samples_from_pb(samples, prompt))
        if not isinstance(values, list | tuple) or len(values) != len(samples):
            got = f"{len(values)} values" if isinstance(values, list | tuple) else repr(values)
            wrong = ValueError(
                f"--custom-rm-path {self.custom_path} (--group-rm) must return a list of "
                f"{len(samples)} rewards (got {got})"
            )
            raise PluginFailed.of(wrong, "--custom-rm-path", self.custom_path, self.service)
        return [self._custom_reward(v) for v in values]

    def _rm_type(self, sample: Sample) -> str:
        from_metadata = _metadata_rm_type(sample.metadata_json)
        if from_metadata:
            return from_metadata
        if not self.cfg.reward.rm_type:
            raise MillstreamError(
                "no reward configured: set --rm-type or --custom-rm-path in the run config "
                "(or rm_type in the sample metadata)"
            )
        return self.cfg.reward.rm_type

    async def _custom(self, sample_or_samples: Any) -> Any:
        """Your function's answer; what it raises as a PluginFailed (module docstring)."""
        assert self.custom is not None
        try:
            return await self._call(self.custom, self.args, sample_or_samples)
        except Exception as err:
            reraise(err, "--custom-rm-path", self.custom_path, self.service)

    def _custom_reward(self, value: Any) -> float:
        """The reward your function returned; PluginFailed when it is none."""
        try:
            return to_reward(value, self.reward_key)
        except ValueError as err:
            flag, path = "--custom-rm-path", self.custom_path
            raise PluginFailed.of(err, flag, path, self.service) from err

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if is_async(fn):
            return await fn(*args)
        out = await self.threads.run(fn, *args)
        return await out if inspect.isawaitable(out) else out

    async def aclose(self) -> None:
        if self.remote is not None:
            await self.remote.aclose()


@functools.lru_cache(maxsize=1024)
def _metadata_rm_type(metadata_json: str) -> str | None:
    """The `rm_type` a sample's metadata names, if any. Cached: a group's samples share
    their metadata (parsing it per sample was a twentieth of the worker's CPU per group)."""
    if not metadata_json:
        return None
    try:
        meta = json.loads(metadata_json)
    except ValueError:
        return None
    if isinstance(meta, dict) and isinstance(meta.get("rm_type"), str) and meta["rm_type"]:
        return meta["rm_type"]
    return None
