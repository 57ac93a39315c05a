"""A crashing plugin stops the run, loudly, instead of failing group after group unseen.

The rollout and reward workers fail a group whose plugin raised with its `plugin_error`
(common/plugin_errors.py). Here, on every scored group the buffer takes in:

* the first time an error (flag, path, type, message) is seen, its traceback goes to the
  trainer's console: "plugin <flag> <path> raised in <service>:" and the traceback;
* a group failed by a plugin adds one to the groups failed in a row; any other group (kept,
  filtered, failed otherwise) sets it back to 0;
* at --max-consecutive-failed-groups in a row (0: never), `check` raises PluginCrashed, which
  ends the trainer's wait (buffer.py) and the run: exit 1, RUN_DIR/summary.json saying which
  plugin raised what (observe/summary.py), and the traceback printed again as the last line
  (the CLI prints a MillstreamError's message).

An intermittent error (one group in ten) never stops the run; it is printed once, and the
groups it fails are counted `failed` as any other.
"""

from __future__ import annotations

import logging

from millstream.common.errors import MillstreamError
from millstream.common.plugin_errors import describe, error_key
from millstream.common.types import PluginError, ScoredGroup

log = logging.getLogger("millstream.trainer")

MAX_PRINTED = 100  # distinct errors whose traceback is printed; more are counted only


def headline(error: PluginError) -> str:
    return f"plugin {error.flag} {error.path} raised in {error.service}:"


class PluginCrashed(MillstreamError):
    """Groups kept failing because a plugin raised: the run stops with its traceback."""

    def __init__(self, error: PluginError, in_row: int, limit: int):
        self.error = error
        self.summary = (
            f"{in_row} groups in a row failed because a plugin raised "
            f"(--max-consecutive-failed-groups {limit}): {describe(error)}"
        )
        super().__init__(f"{self.summary}\n{headline(error)}\n{error.traceback.rstrip()}")


class PluginFailures:
    """See the module docstring. `observe` each arriving group; `check` where one waits."""

    def __init__(self, max_in_row: int):
        self.max_in_row = max_in_row
        self.in_row = 0
        self.total = 0
        self.crashed: PluginCrashed | None = None
        self._printed: set[tuple[str, str, str, str]] = set()

    def observe(self, scored: ScoredGroup) -> None:
        error = _plugin_error(scored)
        if error is None:
            self.in_row = 0
            return
        self.total += 1
        self.in_row += 1
        key = error_key(error)
        if key not in self._printed and len(self._printed) < MAX_PRINTED:
            self._printed.add(key)
            log.error("%s\n%s", headline(error), error.traceback.rstrip())
        if self.crashed is None and self.max_in_row and self.in_row >= self.max_in_row:
            self.crashed = PluginCrashed(error, self.in_row, self.max_in_row)

    def check(self) -> None:
        """PluginCrashed once the limit was reached (module docstring)."""
        if self.crashed is not None:
            raise self.crashed


def _plugin_error(scored: ScoredGroup) -> PluginError | None:
    if scored.HasField("plugin_error"):
        return scored.plugin_error
    if scored.group.HasField("plugin_error"):  # a reward worker that did not copy it over
        return scored.group.plugin_error
    return None
