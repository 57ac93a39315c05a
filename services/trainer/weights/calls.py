"""The weight sync's calls to engines' admin endpoints (sync.py), how they fail, and the report
every step of a sync writes into (`SyncReport`).

Every call carries the admin token when one is set (`Authorization: Bearer`, common/auth.py)
and is bounded by --weight-sync-timeout in total; a call fails on no answer, on an HTTP error,
on a status other than 200, and on a 200 whose JSON says `"success": false` (SGLang answers
some failures so). A failure comes back as its reason and the seconds into the step it came
(`Failure`): the group's blame (routes/nccl.py) tells an engine that refused early from one
that waited on a peer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from millstream.common import aio, telemetry
from millstream.common.auth import bearer_headers
from millstream.common.fencing import FencedOut

ALIVE_PATHS = ("/health", "/get_server_info")  # `EngineCalls.alive`: either answering will do


@dataclass
class SyncReport:
    """What one weight sync did (sync.py), filled in by every step as it goes."""

    version: int
    engines: list[str] = field(default_factory=list)  # the engines that serve `version` now
    removed: dict[str, str] = field(default_factory=dict)  # engine url -> why it was removed
    bytes: int = 0
    buckets: int = 0
    new_group: bool = False  # the update group was (re)built in this sync
    attempts: int = 1  # > 1 when a broken group was rebuilt and the buckets sent again
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    # The last bucket asks the engines to flush their cache, except with --pause-mode in_place:
    # the paused requests keep running on their KV cache (SGLang refuses the flush, and so the
    # update, while any request is in its running batch).
    flush_cache: bool = True

    def add_time(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


class Calls(Protocol):
    """What the routes need of `EngineCalls` (tests stand in for it)."""

    async def each(
        self, urls: list[str], path: str, body: Callable[[int, str], dict[str, Any]]
    ) -> Mapping[str, object]: ...


@dataclass(frozen=True)
class Failure:
    """Why an engine's call failed, and how many seconds into the step it did."""

    reason: str
    seconds: float

    def __str__(self) -> str:
        return self.reason


class EngineCalls:
    """POSTs to engines' admin endpoints, with the admin token when one is set, each bounded
    by `timeout_s` in total; failures come back as reasons."""

    def __init__(self, http: httpx.AsyncClient, timeout_s: float, admin_token: str | None):
        self.http, self.timeout_s = http, timeout_s
        self.headers = bearer_headers(admin_token)

    async def post(self, url: str, path: str, body: dict[str, Any]) -> None:
        headers = telemetry.inject_headers(dict(self.headers))
        try:
            resp = await aio.wait_for(
                self.http.post(url + path, json=body, headers=headers), self.timeout_s
            )
        except TimeoutError:
            raise RuntimeError(
                f"{path}: no answer within {self.timeout_s:g} s (--weight-sync-timeout)"
            ) from None
        except httpx.HTTPError as err:
            raise RuntimeError(f"{path}: {type(err).__name__}: {err}") from None
        if resp.status_code == 409 and "fenced" in resp.text:  # common/fencing.py
            raise FencedOut(f"engine {url}{path}: {resp.text[:300]}")
        if resp.status_code != 200 or not succeeded(resp):
            raise RuntimeError(f"{path}: HTTP {resp.status_code}: {resp.text[:300]}")

    async def each(
        self, urls: list[str], path: str, body: Callable[[int, str], dict[str, Any]]
    ) -> dict[str, Failure]:
        """POST to every engine concurrently; the ones that failed, with why and when."""
        start = time.monotonic()

        async def one(i: int, url: str) -> Failure | None:
            try:
                await self.post(url, path, body(i, url))
            except FencedOut:  # not the engine's failure: this trainer must stop
                raise
            except Exception as err:
                return Failure(str(err), time.monotonic() - start)
            return None

        results = await asyncio.gather(*(one(i, u) for i, u in enumerate(urls)))
        return {u: r for u, r in zip(urls, results, strict=True) if r is not None}

    async def alive(self, urls: list[str], probe_s: float = 5.0) -> set[str]:
        """The engines among `urls` that answer GET /health or GET /get_server_info with 200
        within `probe_s` (at most the sync timeout). Both: SGLang's /health is a one-token
        generation, which takes at least a second and hangs while the server is paused (every
        sync pauses it: 503 after 20 s), while its /get_server_info is its scheduler's state,
        answered paused or not, and not while the scheduler is blocked (rendezvous.py).
        millstream's engine answers both at once; an engine of another kind, /health."""

        async def answers(url: str, path: str) -> bool:
            try:
                resp = await aio.wait_for(self.http.get(url + path), probe_s)
            except (TimeoutError, httpx.HTTPError):
                return False
            return resp.status_code == 200

        async def check(url: str) -> bool:
            probes = [asyncio.ensure_future(answers(url, p)) for p in ALIVE_PATHS]
            try:
                for probe in asyncio.as_completed(probes):
                    if await probe:
                        return True
                return False
            finally:
                for probe in probes:
                    probe.cancel()

        probe_s = min(probe_s, self.timeout_s)
        answers_ = await asyncio.gather(*(check(u) for u in urls))
        return {u for u, ok in zip(urls, answers_, strict=True) if ok}

    async def info(self, url: str) -> dict[str, Any] | None:
        """The engine's GET /get_server_info (None: no answer within a few seconds, or not a
        JSON object): where it lives, its ranks, its checkpoint."""
        try:
            probe_s = min(5.0, self.timeout_s)  # as `alive`: a hung engine waits no longer
            resp = await aio.wait_for(self.http.get(url + "/get_server_info"), probe_s)
            info = resp.json() if resp.status_code == 200 else None
        except (TimeoutError, httpx.HTTPError, ValueError):
            return None
        return info if isinstance(info, dict) else None


def succeeded(resp: httpx.Response) -> bool:
    try:
        data = resp.json()
    except ValueError:
        return True  # SGLang answers some control calls with plain text
    return not (isinstance(data, dict) and data.get("success") is False)
