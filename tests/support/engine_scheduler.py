"""A scheduler built as `millstream engine` builds it, for the tests that drive it in-process.

engine/core.py `new_batch` turns the flags into the running batch (its pool sized by
engine/kv/sizing.py, its context capped at the pool); the Scheduler takes that batch. A test
that wants a batch of its own (a pool of an exact size, never grown) builds a PagedBatch and
passes it to Scheduler itself.
"""

from __future__ import annotations

from typing import Any

from millstream.engine.config import EngineConfig
from millstream.engine.core import new_batch
from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.scheduler import Scheduler


def engine_scheduler(runner: ModelRunner, **flags: Any) -> Scheduler:
    """The scheduler `millstream engine --model-path <runner's model>` would run with `flags`,
    by EngineConfig field (max_running_requests=8, max_total_tokens=96, context_length=256),
    not started."""
    config = EngineConfig(model_path=runner.model_path, **flags)
    return Scheduler(runner, new_batch(runner, config))
