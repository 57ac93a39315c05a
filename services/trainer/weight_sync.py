"""Weight sync: the coordinator handshake of DESIGN.md section 5, trainer rank 0's side.

    engines = router GET /list_workers (after POST /add_worker for engines asking to join)
    1. pause    every engine: /pause_generation {mode: --pause-mode}                 concurrently
    2. group    when there is none or membership changed: destroy the old one (rank 0 and, best
                effort, the engines), then every engine /init_weights_update_group {master
                address, a fresh port, rank_offset 1+i, world_size 1+n} while rank 0 joins
    3. buckets  for each bucket of <= --update-weight-buffer-size bytes: every engine
                /update_weights_from_distributed {names, dtypes, shapes, group_name}
                concurrently with rank 0's broadcast of the bucket's tensors
    4. serve    router /set_weight_version str(V), then every engine /continue_generation

Invariants:
  * an engine reports version V only once it holds all of V's tensors: weight_version (and
    flush_cache) go with the last bucket only;
  * the router's served version moves before any engine continues, so no sample is generated
    by an engine that missed V (version-gated routing);
  * nothing waits forever: every HTTP call is bounded by --weight-sync-timeout in total, and
    so is every collective of the group (gloo/NCCL timeout); rank 0's blocking work runs in a
    thread, so the event loop keeps serving the engines' HTTP calls meanwhile;
  * an engine that fails or times out in any step is removed from routing (`/remove_worker`)
    and named in the report with the reason, and the sync goes on with the rest. When the
    group itself breaks (rank 0's join or a broadcast fails), it is torn down on both sides,
    rebuilt with the engines still standing, and every bucket is sent again, so the same sync
    completes for the healthy engines;
  * no engine left, or a group that breaks twice with no engine at fault: MillstreamError.

Blame when a group step breaks (`_blame`): in one collective, a peer that is missing makes
everyone else wait and time out, so failing is not proof of fault. At fault are, in order:
engines that failed and then do not answer /health (dead or hung); else engines that failed
while rank 0 or another engine succeeded; else, when all failed, those that failed early
(before half the timeout: they refused, the rest waited on them). When all failed alike,
nobody is removed: the group is rebuilt once, and a second such failure points at rank 0
(e.g. engines cannot reach --master-address) and raises.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from millstream.common import telemetry
from millstream.common.errors import MillstreamError, ServiceUnavailable

from .process_group import BACKENDS, Bucket, NamedTensors, UpdateGroup, backend_for, plan_buckets

log = logging.getLogger("millstream.trainer")


@dataclass
class SyncReport:
    version: int
    engines: list[str] = field(default_factory=list)  # the engines that serve `version` now
    removed: dict[str, str] = field(default_factory=dict)  # engine url -> why it was removed
    bytes: int = 0
    buckets: int = 0
    new_group: bool = False  # the update group was (re)built in this sync
    attempts: int = 1  # > 1 when a broken group was rebuilt and the buckets sent again
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


class GroupBroken(Exception):
    """One step of the update group failed somewhere: on rank 0 and/or on some engines."""

    def __init__(self, step: str, rank0: BaseException | None, failed: dict[str, Failure]):
        self.step, self.rank0, self.failed = step, rank0, failed
        where = [f"rank 0: {type(rank0).__name__}: {rank0}"] if rank0 else []
        where += [f"{url}: {why}" for url, why in failed.items()]
        super().__init__(f"{step} failed ({'; '.join(where)})")


@dataclass(frozen=True)
class Failure:
    """Why an engine's call failed, and how many seconds into the step it did."""

    reason: str
    seconds: float

    def __str__(self) -> str:
        return self.reason


class EngineCalls:
    """POSTs to engines, each bounded by `timeout_s` in total; failures come back as reasons."""

    def __init__(self, http: httpx.AsyncClient, timeout_s: float):
        self.http, self.timeout_s = http, timeout_s

    async def post(self, url: str, path: str, body: dict[str, Any]) -> None:
        headers = telemetry.inject_headers({})
        try:
            resp = await asyncio.wait_for(
                self.http.post(url + path, json=body, headers=headers), self.timeout_s
            )
        except TimeoutError:
            raise RuntimeError(
                f"{path}: no answer within {self.timeout_s:g} s (--weight-sync-timeout)"
            ) from None
        except httpx.HTTPError as err:
            raise RuntimeError(f"{path}: {type(err).__name__}: {err}") from None
        if resp.status_code != 200 or not _succeeded(resp):
            raise RuntimeError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")

    async def each(
        self, urls: list[str], path: str, body: Callable[[int, str], dict[str, Any]]
    ) -> dict[str, Failure]:
        """POST to every engine concurrently; the ones that failed, with why and when."""
        start = time.monotonic()

        async def one(i: int, url: str) -> Failure | None:
            try:
                await self.post(url, path, body(i, url))
            except Exception as err:
                return Failure(str(err), time.monotonic() - start)
            return None

        results = await asyncio.gather(*(one(i, u) for i, u in enumerate(urls)))
        return {u: r for u, r in zip(urls, results, strict=True) if r is not None}

    async def alive(self, urls: list[str]) -> set[str]:
        """The engines among `urls` that answer GET /health within a few seconds."""

        async def check(url: str) -> bool:
            try:
                resp = await asyncio.wait_for(self.http.get(url + "/health"), probe_s)
            except (TimeoutError, httpx.HTTPError):
                return False
            return resp.status_code == 200

        probe_s = min(5.0, self.timeout_s)
        answers = await asyncio.gather(*(check(u) for u in urls))
        return {u for u, ok in zip(urls, answers, strict=True) if ok}


def _succeeded(resp: httpx.Response) -> bool:
    try:
        data = resp.json()
    except ValueError:
        return True  # SGLang answers some control calls with plain text
    return not (isinstance(data, dict) and data.get("success") is False)


class RouterAdmin:
    """The router's admin endpoints the sync needs (Miles router API)."""

    def __init__(
        self, http: httpx.AsyncClient, url: str, admin_token: str | None, timeout_s: float
    ):
        self.http, self.url, self.timeout_s = http, url, timeout_s
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = telemetry.inject_headers(dict(self.headers))
        try:
            resp = await asyncio.wait_for(
                self.http.request(method, self.url + path, headers=headers, **kwargs),
                self.timeout_s,
            )
            resp.raise_for_status()
            return resp.json()
        except (TimeoutError, httpx.HTTPError, ValueError) as err:
            detail = err.response.text[:300] if isinstance(err, httpx.HTTPStatusError) else err
            raise ServiceUnavailable(
                f"router {self.url}: {method} {path} failed ({type(err).__name__}: {detail}); "
                "is the router running, and is --admin-token right?"
            ) from None

    async def engines(self) -> list[str]:
        return list((await self._call("GET", "/list_workers"))["urls"])

    async def add(self, url: str) -> None:
        await self._call("POST", "/add_worker", params={"url": url})

    async def remove(self, url: str) -> None:
        await self._call("POST", "/remove_worker", params={"url": url})

    async def set_version(self, version: str) -> list[str]:
        """Serve `version` only; returns the engines the router routes to now."""
        body = await self._call("POST", "/set_weight_version", json={"weight_version": version})
        return list(body.get("eligible", []))


class WeightSync:
    """Pushes the trainer's weights to every engine behind the router (module docstring)."""

    def __init__(
        self,
        router_url: str,
        *,
        admin_token: str | None = None,
        pause_mode: str = "abort",
        bucket_bytes: int = 512 * 1024**2,
        timeout_s: float = 120.0,
        master_address: str = "127.0.0.1",
        backend: str | None = None,
        group_name: str = "millstream_weights",
        tracer: Any = None,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s (--weight-sync-timeout) must be > 0 (got {timeout_s})")
        if not router_url:
            raise ValueError("router_url: the weight sync needs the router that lists the engines")
        if backend not in (None, *BACKENDS):
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS} (or None: by device)")
        self.router_url = router_url.rstrip("/")
        self.admin_token = admin_token
        self.pause_mode = pause_mode
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.master_address = master_address
        self.backend = backend
        self.group_name = group_name
        self._tracer = tracer or telemetry.tracer("millstream.trainer")
        self._group: UpdateGroup | None = None
        self._members: list[str] = []
        self._generation = itertools.count(1)
        # One client for the life of the trainer's event loop, made at the first sync (a new
        # one per sync built its SSL context and opened fresh connections every time: a
        # third of a small model's sync). Use one WeightSync from one event loop.
        self._http: httpx.AsyncClient | None = None

    @property
    def members(self) -> list[str]:
        """The engines of the current update group, in rank order (rank i+1)."""
        return list(self._members)

    async def sync(
        self,
        named_tensors: NamedTensors | Callable[[], NamedTensors],
        version: int,
        *,
        join: Sequence[str] = (),
    ) -> SyncReport:
        """Push the tensors to every engine as `version`; `join`: engines to add first."""
        source = named_tensors() if callable(named_tensors) else named_tensors
        buckets = plan_buckets(source, self.bucket_bytes)
        if not buckets:
            raise MillstreamError(f"weight sync v{version}: no tensors to send")
        report = SyncReport(version, bytes=sum(b.nbytes for b in buckets), buckets=len(buckets))
        start = time.monotonic()
        with self._tracer.start_as_current_span("trainer.weight_sync") as span:
            span.set_attributes(
                {"version": version, "bytes": report.bytes, "buckets": len(buckets)}
            )
            calls, router = self._clients()
            engines = await self._paused_engines(calls, router, join, report)
            backend = self.backend or backend_for(buckets[0].tensors[0].device)
            engines = await self._push(calls, router, engines, buckets, backend, report)
            await self._serve(calls, router, engines, report)
            report.engines = engines
            report.add_time("total", time.monotonic() - start)
            span.set_attributes({"engines": len(engines), "removed": len(report.removed)})
        log.info(
            "weight sync v%d: %d engine(s), %.1f MB in %d bucket(s), %.2fs (%s)%s",
            version,
            len(engines),
            report.bytes / 1e6,
            report.buckets,
            report.seconds["total"],
            " ".join(f"{k}={v:.2f}s" for k, v in report.seconds.items() if k != "total"),
            f"; removed {report.removed}" if report.removed else "",
        )
        return report

    async def close(self) -> None:
        """Leave the update group on both sides (best effort on engines); close the client."""
        try:
            await self._drop_group(self._clients()[0], self._members)
        finally:
            if self._http is not None:
                await self._http.aclose()
                self._http = None

    def _clients(self) -> tuple[EngineCalls, RouterAdmin]:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.timeout_s)
        return (
            EngineCalls(self._http, self.timeout_s),
            RouterAdmin(self._http, self.router_url, self.admin_token, self.timeout_s),
        )

    # -- the steps --------------------------------------------------------------------------

    async def _paused_engines(
        self, calls: EngineCalls, router: RouterAdmin, join: Sequence[str], report: SyncReport
    ) -> list[str]:
        start = time.monotonic()
        for url in join:
            await router.add(url)
        engines = sorted(await router.engines())
        failed = await calls.each(
            engines, "/pause_generation", lambda _i, _u: {"mode": self.pause_mode}
        )
        engines = await self._remove(router, engines, failed, report)
        report.add_time("pause", time.monotonic() - start)
        log.info("weight sync v%d: paused %d engine(s)", report.version, len(engines))
        return engines

    async def _push(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        engines: list[str],
        buckets: list[Bucket],
        backend: str,
        report: SyncReport,
    ) -> list[str]:
        """Steps 2 and 3, rebuilding a broken group with the engines still standing."""
        unexplained = 0
        while True:
            if not engines:
                raise MillstreamError(
                    f"weight sync v{report.version}: no engine left to sync (removed: "
                    f"{report.removed or 'none; the router lists no engine'}); start engines "
                    f"and register them with the router {self.router_url}"
                )
            try:
                group = self._group
                if group is None or self._members != engines or group.backend != backend:
                    group = await self._rebuild(calls, engines, backend, report)
                await self._send(calls, group, engines, buckets, report)
                return engines
            except GroupBroken as broken:
                log.warning("weight sync v%d: %s; rebuilding the group", report.version, broken)
                start = time.monotonic()
                culprits = await self._blame(calls, broken, engines)
                await self._drop_group(calls, [u for u in engines if u not in culprits])
                unexplained = 0 if culprits else unexplained + 1
                if unexplained > 1:
                    raise MillstreamError(
                        f"weight sync v{report.version}: {broken}, twice, and no engine is at "
                        f"fault: can the engines reach rank 0 at {self.master_address} "
                        "(--master-address)? Is the collective backend usable?"
                    ) from broken
                engines = await self._remove(router, engines, culprits, report)
                report.attempts += 1
                report.add_time("recover", time.monotonic() - start)

    async def _rebuild(
        self, calls: EngineCalls, engines: list[str], backend: str, report: SyncReport
    ) -> UpdateGroup:
        start = time.monotonic()
        # Old members that left between syncs are asked too: they may still hold the group.
        await self._drop_group(calls, [u for u in self._members if u not in report.removed])
        name = f"{self.group_name}_{next(self._generation)}"
        group = UpdateGroup(name, 1 + len(engines), backend, self.master_address, self.timeout_s)
        self._group, self._members = group, list(engines)

        def body(i: int, _url: str) -> dict[str, Any]:
            return {
                "master_address": self.master_address,
                "master_port": group.port,
                "rank_offset": 1 + i,
                "world_size": group.world_size,
                "group_name": name,
                "backend": backend,
            }

        try:
            await self._group_step(calls, "/init_weights_update_group", engines, body, group.join)
        finally:
            report.add_time("init", time.monotonic() - start)
        report.new_group = True
        log.info(
            "weight sync v%d: update group %r of %d (%s, port %d) in %.2fs",
            report.version, name, group.world_size, backend, group.port,
            time.monotonic() - start,
        )  # fmt: skip
        return group

    async def _send(
        self,
        calls: EngineCalls,
        group: UpdateGroup,
        engines: list[str],
        buckets: list[Bucket],
        report: SyncReport,
    ) -> None:
        start = time.monotonic()
        try:
            for k, bucket in enumerate(buckets):
                body = {**bucket.spec(), "group_name": group.name, "flush_cache": False}
                if k == len(buckets) - 1:
                    body.update(weight_version=str(report.version), flush_cache=True)
                await self._group_step(
                    calls,
                    "/update_weights_from_distributed",
                    engines,
                    lambda _i, _u, body=body: body,
                    lambda bucket=bucket: group.broadcast(bucket.tensors),
                    label=f"bucket {k + 1}/{len(buckets)}",
                )
        finally:
            report.add_time("broadcast", time.monotonic() - start)

    async def _serve(
        self, calls: EngineCalls, router: RouterAdmin, engines: list[str], report: SyncReport
    ) -> None:
        start = time.monotonic()
        eligible = await router.set_version(str(report.version))
        report.add_time("router", time.monotonic() - start)
        late = [u for u in engines if u not in eligible]
        if late:
            log.warning("weight sync v%d: router does not route to %s yet", report.version, late)
        start = time.monotonic()
        failed = await calls.each(engines, "/continue_generation", lambda _i, _u: {})
        engines[:] = await self._remove(router, engines, failed, report)
        report.add_time("continue", time.monotonic() - start)

    # -- group bookkeeping ------------------------------------------------------------------

    async def _group_step(
        self,
        calls: EngineCalls,
        path: str,
        engines: list[str],
        body: Callable[[int, str], dict[str, Any]],
        rank0: Callable[[], None],
        label: str = "",
    ) -> None:
        """Call `path` on every engine while rank 0 runs its side in a thread."""
        results = await asyncio.gather(
            asyncio.to_thread(rank0), calls.each(engines, path, body), return_exceptions=True
        )
        rank0_result, failed = results
        if isinstance(failed, BaseException):
            raise failed
        rank0_error = rank0_result if isinstance(rank0_result, BaseException) else None
        if rank0_error is not None and not isinstance(rank0_error, Exception):
            raise rank0_error
        if rank0_error is not None or failed:
            raise GroupBroken(f"{path} {label}".strip(), rank0_error, failed)

    async def _blame(
        self, calls: EngineCalls, broken: GroupBroken, engines: list[str]
    ) -> dict[str, str]:
        """The engines at fault for a broken group step (module docstring)."""
        failed = broken.failed
        alive = await calls.alive(list(failed))
        dead = {u: f"{f}; then no answer to /health" for u, f in failed.items() if u not in alive}
        if dead:
            return dead
        if broken.rank0 is None or len(failed) < len(engines):
            return {u: str(f) for u, f in failed.items()}
        # Everyone failed: the ones that gave up early broke ranks, the rest waited on them.
        early = {u: str(f) for u, f in failed.items() if f.seconds < self.timeout_s / 2}
        return early if len(early) < len(failed) else {}

    async def _drop_group(self, calls: EngineCalls, notify: list[str]) -> None:
        group, self._group, self._members = self._group, None, []
        if group is None:
            return
        await asyncio.to_thread(group.destroy)
        failed = await calls.each(
            notify, "/destroy_weights_update_group", lambda _i, _u: {"group_name": group.name}
        )
        for url, why in failed.items():
            log.info("leaving update group %r on %s failed (ignored): %s", group.name, url, why)

    async def _remove(
        self,
        router: RouterAdmin,
        engines: list[str],
        failed: Mapping[str, object],
        report: SyncReport,
    ) -> list[str]:
        for url, why in failed.items():
            log.error(
                "weight sync v%d: removing engine %s from routing: %s", report.version, url, why
            )
            await router.remove(url)
            report.removed[url] = str(why)
        return [u for u in engines if u not in failed]
