"""Custom log functions for the tracking tests (`--custom-rollout-log-function-path
tests.support.log_plugins.record_rollout`, ...), with Miles' signatures; each call is kept in
CALLS for the test to read."""

from __future__ import annotations

from typing import Any

CALLS: list[tuple[str, tuple[Any, ...]]] = []


def record_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    CALLS.append(("rollout", (rollout_id, args, samples, rollout_extra_metrics, rollout_time)))
    return False


def skip_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    CALLS.append(("rollout", (rollout_id, args, samples, rollout_extra_metrics, rollout_time)))
    return True


def raising_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    raise ValueError("statsd is down")


async def async_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    return True


def record_eval(rollout_id, args, data, extra_metrics) -> bool:
    CALLS.append(("eval", (rollout_id, args, data, extra_metrics)))
    return False


def skip_eval(rollout_id, args, data, extra_metrics) -> bool:
    CALLS.append(("eval", (rollout_id, args, data, extra_metrics)))
    return True


def raising_eval(rollout_id, args, data, extra_metrics) -> bool:
    raise KeyError("aime")


def tracked_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """Miles' default shape: its own row through `tracking.log`, then the default skipped."""
    from miles.utils.metric_utils import compute_statistics, dict_add_prefix
    from miles.utils.tracking_utils import tracking

    rewards = [s.reward for s in samples]
    log_dict = dict_add_prefix(compute_statistics(rewards), "rollout/my_reward/")
    tracking.log(args, {**log_dict, "rollout/step": rollout_id}, step_key="rollout/step")
    return True
