"""Background health checks: every worker, in parallel, every `interval` seconds (every
FAST_INTERVAL_S while none can take traffic).

A check is `GET /health` within `timeout`; when the router has an expected weight version it
is a GET of the worker's version instead (`{"weight_version": ...}`: alive, and which weights;
/get_weight_version on millstream's engine, /model_info on SGLang, which has no such route:
VERSION_PATHS, the first that answers kept per worker), so a worker that rejoined with old
weights stays out until it reports the expected one. Outcomes
go to the Registry, which owns the state transitions; this module only does the I/O and the
schedule.

Spread: with more than SPREAD_BATCH workers, a round at `interval` checks them SPREAD_BATCH at
a time, the batches spread evenly over the interval, instead of all at once: a round of 256
checks at once held the router's event loop for tens of ms every interval, and every request
that arrived meanwhile waited (the router's p99 grew with the fleet, bench/bench_fleet.py).
Each batch starts at its slot whatever the earlier ones still wait for (silent workers in a
partition), so each worker is still checked once an interval, and a round takes `interval` plus
one batch's checks at most. Fast rounds (nothing can take traffic) and the first round check
every worker at once.

Invariant: one batch never takes longer than `timeout` (+ scheduling) per version path tried
(three at most, once per worker), whatever the workers do, and a failing round never stops the
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from .registry import HEALTHY, Registry, Worker

log = logging.getLogger("millstream.router")

FAST_INTERVAL_S = 0.05
SPREAD_BATCH = 8  # workers checked together in a spread round (module docstring)
# Where a worker says its weight version: millstream's engine, then SGLang (0.5.23: /model_info;
# older: /get_model_info). `weight_version` in the JSON of each.
VERSION_PATHS = ("/get_weight_version", "/model_info", "/get_model_info")


class HealthChecker:
    def __init__(
        self, registry: Registry, client: httpx.AsyncClient, interval: float, timeout: float
    ):
        self.registry = registry
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self._task: asyncio.Task | None = None
        # The path each worker says its version on (VERSION_PATHS), once found.
        self._version_path: dict[str, str] = {}

    async def _get_version(self, worker: Worker) -> httpx.Response:
        """GET the worker's version: millstream's engine answers /get_weight_version; SGLang
        (0.5.23) has no such route and says `weight_version` in /model_info (older servers:
        /get_model_info). The first path that is not a 404 is kept for the worker."""
        known = self._version_path.get(worker.url)
        for path in (known,) if known else VERSION_PATHS:
            response = await self.client.get(worker.url + path, timeout=self.timeout)
            if response.status_code != 404:
                self._version_path[worker.url] = path
                return response
        return response

    async def check(self, worker: Worker) -> None:
        was = worker.status
        # With a version to gate on, the version is the probe: an answer proves the worker
        # up and says its version, in one round trip (a weight sync waits on it).
        gated = self.registry.expected_version is not None
        path = "/health"
        probed_at = time.monotonic()
        try:
            if gated:
                response = await self._get_version(worker)
                path = self._version_path.get(worker.url, VERSION_PATHS[-1])
            else:
                response = await self.client.get(worker.url + path, timeout=self.timeout)
        except httpx.HTTPError as err:
            self.registry.record_failure(worker, f"health check failed: {type(err).__name__}")
        else:
            if gated and response.status_code == 404:  # up, but cannot say its version
                self.registry.record_success(worker)
                self.registry.record_version_unknown(
                    worker, f"none of {', '.join(VERSION_PATHS)} answered (404)"
                )
            elif response.status_code != 200:
                self.registry.record_failure(worker, f"{path} returned {response.status_code}")
            else:
                self.registry.record_success(worker)
                if gated:
                    self._record_version(worker, response, probed_at)
        if worker.status != was:
            log.warning(
                "router: worker %s is now %s%s",
                worker.url,
                worker.status,
                "" if worker.status == HEALTHY else f" ({worker.last_error})",
            )

    async def answers(self, url: str) -> bool:
        """`url` answers GET /health with 200 within the timeout: a worker not registered
        yet (discovery.py) that is up."""
        try:
            response = await self.client.get(url + "/health", timeout=self.timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _record_version(self, worker: Worker, response: httpx.Response, probed_at: float) -> None:
        try:
            version = response.json()["weight_version"]
        except (ValueError, KeyError, TypeError) as err:
            self.registry.record_version_unknown(
                worker, f"its weight version unreadable: {type(err).__name__}: {err}"
            )
            return
        self.registry.record_version(worker, None if version is None else str(version), probed_at)

    async def check_all(self) -> None:
        workers = self.registry.all()
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    def next_wait(self) -> float:
        """Seconds to the next round: `interval`, or FAST_INTERVAL_S while workers are
        registered but none can take traffic (start-up, every engine down). A router with
        nothing to serve loses nothing by looking often, and the run starts as soon as the
        first engine answers, not up to `interval` later."""
        if self.registry.all() and not self.registry.eligible():
            return min(self.interval, FAST_INTERVAL_S)
        return self.interval

    async def _loop(self) -> None:
        while True:
            try:
                wait = self.next_wait()
                if wait < self.interval or len(self.registry) <= SPREAD_BATCH:
                    await asyncio.sleep(wait)
                    await self.check_all()
                else:
                    await self.spread_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end health checking for good
                log.exception("router: health-check round failed")

    async def spread_round(self) -> None:
        """Every worker once, SPREAD_BATCH at a time, the batches started on a fixed timeline
        over `interval` (module docstring): a batch of silent workers does not push the next
        one back, so a round takes `interval` plus one batch's checks at most. Over early when
        no worker can take traffic any more (then fast rounds check them all at once)."""
        workers = self.registry.all()
        batches = [workers[i : i + SPREAD_BATCH] for i in range(0, len(workers), SPREAD_BATCH)]
        gap = self.interval / max(1, len(batches))
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with asyncio.TaskGroup() as group:  # waits for every batch started; a cancel ends all
            for k, batch in enumerate(batches):
                await asyncio.sleep(max(0.0, start + (k + 1) * gap - loop.time()))
                if self.next_wait() < self.interval:
                    break
                group.create_task(self._check_batch(batch))

    async def _check_batch(self, batch: list[Worker]) -> None:
        await asyncio.gather(*(self.check(w) for w in batch if self.registry.get(w.url) is w))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
