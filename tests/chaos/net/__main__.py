"""`make chaos-net`: network partitions as silence, each service in a namespace of its own.

    python -m tests.chaos.net                 # every scenario (about 8 minutes on 2 cores)
    python -m tests.chaos.net engine          # those whose name contains "engine"

Root only (network namespaces): elsewhere it says why and runs nothing. The table is
`make chaos`'s (tests/chaos/__main__.py), computed from each run's summary.json and
metrics.jsonl; the exit code is 1 when any scenario broke a promise.
"""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from ..__main__ import main as run_suite
from ..harness import Row
from . import scenarios
from .netns import unavailable

Scenario = Callable[[Path, Path], Row]


def guarded(fault: str, scenario: Scenario) -> Scenario:
    """A scenario that raised (a wait that timed out, a service that never started) is a
    row that failed with the traceback, and the other scenarios still run."""

    def run(workdir: Path, model: Path) -> Row:
        try:
            return scenario(workdir, model)
        except Exception:
            return Row(fault, 0, "raised", problems=[traceback.format_exc()])

    return run


NET: dict[str, Scenario] = {
    "trainer_redis_30s": lambda w, m: scenarios.trainer_redis(w, m, iterations=300, seconds=30),
    "engine_in_sync": lambda w, m: scenarios.engine_in_sync(
        w, m, iterations=400, seconds=20, sync_timeout=10
    ),
    "only_engine_60s": lambda w, m: scenarios.only_engine(w, m, iterations=200, seconds=60),
    "rollout_worker": lambda w, m: scenarios.rollout_worker(
        w, m, iterations=300, seconds=15, claim_idle_s=5
    ),
    "redis_isolated_20s": lambda w, m: scenarios.redis_isolated(w, m, iterations=300, seconds=20),
    "trainer_replaced": lambda w, m: scenarios.trainer_replaced(
        w, m, iterations=300, seconds=30, ttl_s=10
    ),
}


def main(argv: list[str]) -> int:
    reason = unavailable()
    if reason:
        print(f"chaos-net: skipped, nothing run: {reason}")
        return 0
    # SIGTERM (a CI runner's, a `timeout`'s) ends the run through the scenarios' `finally`:
    # every process killed, every namespace deleted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    suite = {name: guarded(name, fn) for name, fn in NET.items()}
    return run_suite(argv, suite, first="partition")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
