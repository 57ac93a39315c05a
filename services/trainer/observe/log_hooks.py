"""Miles' custom log functions, which the trainer's MetricsLogger (metrics.py) calls.

    --custom-rollout-log-function-path pkg.mod.fn
        fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool
    --custom-eval-rollout-log-function-path pkg.mod.fn
        fn(rollout_id, args, data, extra_metrics) -> bool

Miles calls them first thing in its default loggers, and a true return skips the default
logging (radixark/miles miles/ray/rollout/metrics.py `log_rollout_data` and
`log_eval_rollout_data`; THUDM/slime slime/observability/rollout_metrics.py is the same). The
eval function takes four arguments there, no rollout_time: so does Miles' --help text.

What the arguments are here, against Miles':

- rollout_id: the 0-based rollout index, as Miles' (stdout's `iter N/M` is rollout N-1; an
  eval after iteration N is rollout N-1's, the eval before training rollout 0's).
- args: Miles' read-only namespace of the run's flags (compat/miles/ `make_args`), built
  from the published config, without secrets (config/store.py `without_secrets`), the same
  `args` the workers' plugins get.
- samples: the iteration's samples, group after group, as Miles' `Sample`
  (compat/miles/; `from miles.utils.types import Sample` imports it): `prompt`,
  `response`, `tokens`, `response_length`, the raw `reward` (the reward worker's, not the
  estimator's group-normalised advantage), `status`, `label`, `metadata`, `group_index`
  (the prompt's data index), `weight_versions`.
- rollout_extra_metrics: the rollout/ metrics the default would log, by tag
  ({"rollout/raw_reward": ...}); Miles passes its rollout function's extra metrics.
- rollout_time: the seconds the trainer waited for the iteration's batch (perf/rollout_time).
- data: {eval set: {"rewards": [...], "truncated": [...], "samples": [...]}}, Miles' shape
  (Miles' `Sample`s again); a failed eval group adds n rewards of 0.0 (as the accuracy counts
  it) and no samples.
- extra_metrics: the eval/ metrics the default would log ({"eval/aime": ...}).

They run in the trainer process, on the event loop's thread, once per iteration or eval: keep
them quick. A true return skips the default tensorboard and wandb logging of that part (the
rollout/ tags, or the eval/ tags), as in Miles; metrics.jsonl and the stdout row are
millstream's own record and still get everything. What the function hands to Miles'
`tracking.log` (miles.utils.tracking_utils, compat/miles/tracking.py), as Miles' default log
function does, goes into the iteration's metrics.jsonl row and the mirrors. An exception in the function stops the run
with a MillstreamError naming the flag and the function's path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError
from millstream.compat.plugins import load_function, workers_sys_path

ROLLOUT = "--custom-rollout-log-function-path"
EVAL = "--custom-eval-rollout-log-function-path"


def paths(cfg: RunConfig) -> dict[str, str]:
    """The log functions given, by flag."""
    given = {
        ROLLOUT: cfg.logging.custom_rollout_log_function_path,
        EVAL: cfg.logging.custom_eval_rollout_log_function_path,
    }
    return {flag: path for flag, path in given.items() if path}


def load(flag: str, path: str) -> Callable[..., Any]:
    """The function, imported as preflight checks it: with the working directory on sys.path
    (the trainer runs there; the `millstream` script does not put it on sys.path)."""
    with workers_sys_path():
        return load_function(path, flag)


class LogHook:
    """A loaded log function; calling it returns whether to skip the default logging."""

    def __init__(self, flag: str, path: str):
        self.flag = flag
        self.path = path
        self.fn = load(flag, path)

    def __call__(self, *args: Any) -> bool:
        try:
            result = self.fn(*args)
        except Exception as err:
            raise MillstreamError(
                f"{self.flag} {self.path!r} raised {type(err).__name__}: {err}"
            ) from err
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()  # never awaited: no "coroutine was never awaited" warning
            raise MillstreamError(
                f"{self.flag} {self.path!r} returned an awaitable: Miles' log functions are "
                "plain (not async) functions"
            )
        return bool(result)


def hooks(cfg: RunConfig) -> dict[str, LogHook]:
    return {flag: LogHook(flag, path) for flag, path in paths(cfg).items()}
