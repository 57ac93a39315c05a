"""The engine's Prometheus metrics, served at GET /metrics on the engine's own port.

Everything is read from the EngineCore at scrape time (the scheduler's counters, its queue
and batch, the weight version), so generating costs nothing extra and the numbers are the
ones /get_server_info reports. Tokens per second: rate(millstream_engine_generated_tokens_total).

`millstream_engine_weight_version` is the version the engine serves as a number: the
trainer's versions are integers ("3"); a version that is none ("default", the flag's default
before any update) reads NaN.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry

from millstream.common.prom import Readings, new_registry


def version_number(version: str) -> float:
    """The weight version as a gauge value: the integer it spells, else NaN."""
    try:
        return float(int(version))
    except ValueError:
        return math.nan


def engine_registry(core: Any) -> CollectorRegistry:
    """A registry of `core`'s metrics (one per app)."""

    def stat(name: str) -> Any:
        return lambda: getattr(core.scheduler.stats, name)

    def info(key: str) -> Any:
        return lambda: core.scheduler.info()[key]

    r = Readings()
    r.add(
        "counter",
        "millstream_engine_generated_tokens",
        "tokens sampled, over every sequence (rate() is tokens/s)",
        stat("generated_tokens"),
    )
    r.add(
        "counter",
        "millstream_engine_completions",
        "sequences that ended, by outcome: finished (a stop condition or length) or aborted",
        lambda: {("finished",): stat("finished")(), ("aborted",): stat("aborted")()},
        labels=("outcome",),
    )
    r.add(
        "counter",
        "millstream_engine_retracted_sequences",
        "running sequences put back in the queue by a pause in retract mode",
        stat("retracted"),
    )
    r.add("counter", "millstream_engine_steps", "scheduler steps", stat("steps"))
    r.add(
        "gauge",
        "millstream_engine_running_requests",
        "sequences in the running batch",
        info("num_running_reqs"),
    )
    r.add(
        "gauge", "millstream_engine_waiting_requests", "sequences queued", info("num_waiting_reqs")
    )
    r.add(
        "gauge",
        "millstream_engine_paused",
        "1 while generation is paused",
        lambda: float(core.scheduler.paused),
    )
    r.add(
        "gauge",
        "millstream_engine_weight_version",
        "weight version served (NaN while it is not an integer, e.g. 'default')",
        lambda: version_number(core.weight_version),
    )
    registry = new_registry()
    registry.register(r)
    return registry
