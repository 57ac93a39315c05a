"""Stand-in for Miles' `miles.utils.tracking_utils` (and its `tracking` module).

Miles' log functions end with `tracking.log(args, log_dict, step_key="rollout/step")`, which
in Miles writes to wandb and tensorboard. Here the trainer owns those (--use-wandb,
--use-tensorboard) and metrics.jsonl: while it calls a custom log function it `collect`s what
the function logs, and puts it in the iteration's metrics.jsonl row and its mirrors (the
trainer's observe/metrics.py). A `tracking.log` outside a log function (a plugin in a worker)
has nowhere to go and is logged at debug level. `init_tracking`, `finish_tracking` and
`define_step_key_metric_group` are no-ops: the trainer starts and ends its own tracking.

`from miles.utils.tracking_utils import tracking` gives this module too (`tracking.log`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["collect", "define_step_key_metric_group", "finish_tracking", "init_tracking", "log"]

__path__: list[str] = []  # `miles.utils.tracking_utils.tracking` imports under it

log_ = logging.getLogger("millstream.miles.tracking")

_collectors: list[dict[str, Any]] = []

tracking = sys.modules[__name__]


def init_tracking(args: Any, primary: bool = True, **kwargs: Any) -> None:
    """No-op: the trainer starts its own tracking from the run's flags."""


def define_step_key_metric_group(prefix: str, step_key: str) -> None:
    """No-op: the trainer files each tag under Miles' step key itself."""


def finish_tracking() -> None:
    """No-op: the trainer closes its own tracking at the end of the run."""


def log(args: Any, metrics: dict[str, Any], step_key: str) -> None:
    """Miles' `tracking.log`: the metrics go to the log row being written (see `collect`)."""
    values = {k: v for k, v in metrics.items() if k != step_key}
    if _collectors:
        _collectors[-1].update(values)
    else:
        log_.debug("tracking.log outside a log function (%s): %s", step_key, sorted(values))


@contextlib.contextmanager
def collect() -> Iterator[dict[str, Any]]:
    """What `log` is given inside the block, tag -> value (the trainer's side)."""
    found: dict[str, Any] = {}
    _collectors.append(found)
    try:
        yield found
    finally:
        _collectors.pop()  # blocks nest: the last one opened is this one
