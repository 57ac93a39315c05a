"""The workers the router knows, their health and the weight version that may serve.

Owns every piece of per-worker state (in-flight count, health status, consecutive check
results, reported weight version) and the router-wide expected weight version.

Invariants:
  * a worker is *eligible* (gets new traffic) only when it is healthy AND, once an expected
    weight version is set, it has reported exactly that version (version-gated routing,
    docs/weight-sync.md): an engine that (re)joins gets no traffic before it has the weights;
  * a worker starts `pending` and is admitted by its first passed check; once `unhealthy`
    (after `failure_threshold` consecutive failures) it needs `success_threshold` passed
    checks in a row to come back;
  * in-flight counts go up and down in pairs (`begin`/`end`) and never below zero,
    also for a worker removed while its requests were still running;
  * a version the caller vouched for (`vouch`) is not undone by a health probe that was
    sent before the vouch (it may have read the version from before the update).

Pure state, no I/O: the health checker and the proxy report outcomes into it. Every change
that can make a worker eligible wakes the requests waiting for one (`wait_for_change`).

The eligible workers are kept as one list, made again only after a change of what decides
eligibility (membership, a worker's status or version, the expected version): every proxied
request reads it, and building it per request cost O(workers) each (bench/bench_fleet.py). A
passed check that changes nothing (the steady state: every worker every interval) is no change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field

from millstream.common import aio

PENDING, HEALTHY, UNHEALTHY = "pending", "healthy", "unhealthy"


@dataclass(eq=False)
class Worker:
    url: str
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    status: str = PENDING
    in_flight: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    weight_version: str | None = None
    vouched_at: float = 0.0  # time.monotonic() of the last vouch for weight_version
    last_error: str | None = None
    last_check: float | None = None
    served: int = 0
    info: dict = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.status == HEALTHY


class Registry:
    def __init__(self, failure_threshold: int = 3, success_threshold: int = 2):
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.expected_version: str | None = None
        self._workers: dict[str, Worker] = {}  # by url, in registration order
        self._change = asyncio.Event()
        self._eligible: list[Worker] | None = None  # `eligible()`, until the next change

    # -- membership -------------------------------------------------------------------------

    def add(self, url: str, info: dict | None = None) -> tuple[Worker, bool]:
        """(worker, created): adding a known url returns the existing worker unchanged."""
        if url in self._workers:
            return self._workers[url], False
        worker = Worker(url=url, info=dict(info or {}))
        self._workers[url] = worker
        self._changed()
        return worker, True

    def remove(self, url: str) -> Worker | None:
        worker = self._workers.pop(url, None)
        self._changed()
        return worker

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def by_id(self, worker_id: str) -> Worker | None:
        return next((w for w in self._workers.values() if w.id == worker_id), None)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    # -- routing ----------------------------------------------------------------------------

    def version_ok(self, worker: Worker) -> bool:
        return self.expected_version is None or worker.weight_version == self.expected_version

    def is_eligible(self, worker: Worker) -> bool:
        return (
            worker.healthy and self.version_ok(worker) and self._workers.get(worker.url) is worker
        )

    def eligible(self) -> list[Worker]:
        """The workers that take new traffic, in registration order (the caller must not
        change the list: it is kept until the next change)."""
        if self._eligible is None:
            self._eligible = [w for w in self._workers.values() if self.is_eligible(w)]
        return self._eligible

    def version_pending(self) -> bool:
        """A version change is under way: a worker is healthy but not yet confirmed at the
        expected version (set ahead of the update, or a rejoined engine being synced). A
        request that finds no eligible worker may wait for it instead of failing."""
        return any(w.healthy and not self.version_ok(w) for w in self._workers.values())

    async def wait_for_change(self, timeout: float) -> None:
        """Return when a worker may have become eligible, or after `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            await aio.wait_for(self._change.wait(), timeout)

    def _changed(self) -> None:
        self._eligible = None
        self._change.set()
        self._change = asyncio.Event()

    def _changed_if(self, worker: Worker, before: tuple[str, str | None]) -> None:
        """`_changed()` when `worker`'s status or version is not `before` any more."""
        if (worker.status, worker.weight_version) != before:
            self._changed()

    def why_none(self) -> str:
        """Why no worker is eligible, for the 503 message."""
        if not self._workers:
            return "no worker registered (add one with POST /add_worker?url=...)"
        parts = []
        for w in self._workers.values():
            if not w.healthy:
                reason = w.status + (f": {w.last_error}" if w.last_error else "")
            else:
                reason = f"at weight version {w.weight_version!r}"
            parts.append(f"{w.url} {reason}")
        want = f" at weight version {self.expected_version!r}" if self.expected_version else ""
        return f"no healthy worker{want}; " + "; ".join(parts)

    def begin(self, worker: Worker) -> None:
        """A request starts on `worker`; pair with exactly one `end`."""
        worker.in_flight += 1
        worker.served += 1

    def end(self, worker: Worker) -> None:
        worker.in_flight -= 1
        assert worker.in_flight >= 0, f"in-flight count of {worker.url} went negative"

    # -- health -----------------------------------------------------------------------------

    def record_success(self, worker: Worker, weight_version: str | None = None) -> None:
        """A passed check; `weight_version` is what the worker reported (None: not asked)."""
        before = (worker.status, worker.weight_version)
        worker.last_check = time.time()
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        worker.last_error = None
        if weight_version is not None:
            worker.weight_version = weight_version
        if worker.status == PENDING or (
            worker.status == UNHEALTHY and worker.consecutive_successes >= self.success_threshold
        ):
            worker.status = HEALTHY
        self._changed_if(worker, before)

    def record_failure(self, worker: Worker, error: str) -> None:
        """A failed check or a refused/broken connection while proxying."""
        before = (worker.status, worker.weight_version)
        worker.last_check = time.time()
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        worker.last_error = error
        if worker.consecutive_failures >= self.failure_threshold:
            worker.status = UNHEALTHY
        self._changed_if(worker, before)

    def record_version(self, worker: Worker, version: str | None, probed_at: float) -> None:
        """The version a health probe sent at `probed_at` (time.monotonic()) read. A probe
        sent before the last vouch may have read the version from before the update: then
        the vouched version stays."""
        if probed_at >= worker.vouched_at:
            before = (worker.status, worker.weight_version)
            worker.weight_version = version
            self._changed_if(worker, before)

    def vouch(self, worker: Worker, version: str) -> None:
        """The caller (a weight sync that heard the worker confirm it) says `worker` holds
        `version` now."""
        worker.weight_version = version
        worker.vouched_at = time.monotonic()
        self._changed()

    def record_version_unknown(self, worker: Worker, error: str) -> None:
        """Healthy, but its weight version could not be read: gated until it can."""
        before = (worker.status, worker.weight_version)
        worker.weight_version = None
        worker.last_error = error
        self._changed_if(worker, before)

    def set_expected_version(self, version: str | None) -> None:
        self.expected_version = version
        self._changed()
