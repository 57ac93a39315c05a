"""Miles' `miles.utils.misc`: `load_function`, `SingletonMeta`, `get_free_port` and small helpers.

`load_function(path)` finds the object as every --*-path flag does here (compat/plugins.py:
`pkg.mod.name` or `pkg.mod:name`, Miles' imports stood in for, an error that names the path),
after Miles' `function_registry` (objects registered by name, for tests). Miles'
`get_current_node_ip` (Ray's) and `call_agent_abort_hook` (its whole-batch rollout's abort) are
not here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .http_utils import is_port_available

__all__ = [
    "FunctionRegistry",
    "SingletonMeta",
    "as_completed_async",
    "filter_keys",
    "function_registry",
    "get_free_port",
    "load_function",
    "should_run_periodic_action",
]

log = logging.getLogger(__name__)


class FunctionRegistry:
    """Objects `load_function` finds by name before it imports anything (Miles' tests use it
    for functions made on the fly)."""

    def __init__(self) -> None:
        self._registry: dict[str, object] = {}

    @contextmanager
    def temporary(self, name: str, fn: object) -> Iterator[None]:
        if name in self._registry:
            raise ValueError(f"{name!r} is registered already")
        self._registry[name] = fn
        try:
            yield
        finally:
            del self._registry[name]

    def get(self, name: str) -> object | None:
        return self._registry.get(name)


function_registry = FunctionRegistry()


def load_function(path: str | None, *, sync_required: bool = False) -> Any:
    """The object at `path` (None for an empty path). With `sync_required`, a ValueError
    unless it is a plain (not async) callable, for callers that call it on an event loop."""
    if not path:
        return None
    fn = function_registry.get(path)
    if fn is None:
        from ..plugins import load_object

        fn = load_object(path, "load_function")
    if sync_required:
        if not callable(fn):
            raise ValueError(f"load_function({path!r}) did not resolve to a callable")
        if inspect.iscoroutinefunction(fn):
            raise ValueError(
                f"load_function({path!r}) resolved to an async function; a synchronous one "
                "is required"
            )
    return fn


class SingletonMeta(type):
    """A class built with it has one instance per process: the first call's arguments make it,
    later calls return it whatever they pass (Miles' GenerateState). Tests start over with
    `SingletonMeta.clear_all_instances()` or `SingletonMeta.clear(cls)`."""

    _instances: dict[type, Any] = {}  # noqa: RUF012 - shared by every class, as Miles'
    _lock = threading.Lock()

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = SingletonMeta._instances.get(cls)
        if instance is None:
            with SingletonMeta._lock:
                instance = SingletonMeta._instances.get(cls)
                if instance is None:
                    instance = SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
        return instance

    @staticmethod
    def clear_all_instances() -> None:
        SingletonMeta._instances.clear()

    @staticmethod
    def clear(cls: type) -> None:
        SingletonMeta._instances.pop(cls, None)


def get_free_port(start_port: int = 10000, consecutive: int = 1) -> int:
    """The first port from start_port up where `consecutive` ports in a row are free."""
    port = start_port
    while not all(is_port_available(port + i) for i in range(consecutive)):
        port += 1
    return port


def should_run_periodic_action(
    rollout_id: int,
    interval: int | None,
    num_rollout_per_epoch: int | None = None,
    num_rollout: int | None = None,
) -> bool:
    """Whether an every-`interval` action (eval, save) runs after rollout_id (0-based): on
    the interval, at an epoch's end, and after the last rollout; never without an interval."""
    if interval is None:
        return False
    if num_rollout is not None and rollout_id == num_rollout - 1:
        return True
    step = rollout_id + 1
    return step % interval == 0 or (
        num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0
    )


async def as_completed_async(tasks: Iterable[Any]) -> AsyncIterator[Any]:
    """The results of `tasks` in the order they finish."""
    for next_done in asyncio.as_completed(tasks):
        yield await next_done


def filter_keys(d: dict[str, Any], interest_keys: Sequence[str]) -> dict[str, Any]:
    """`d` cut down to `interest_keys`; KeyError (logged with d's keys) when one is missing."""
    try:
        return {k: d[k] for k in interest_keys}
    except KeyError:
        log.error("filter_keys: keys %s, wanted %s", list(d), list(interest_keys))
        raise
