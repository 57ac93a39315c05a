"""The router's admin endpoints the trainer needs (Miles' router API), ridden through a restart.

    GET  /list_workers                 the engines the router lists
    GET  /workers                      the same with each one's eligibility (sglang-router's shape)
    POST /add_worker, /remove_worker   membership
    POST /set_weight_version           the version the router routes to

What it owns: the trainer's view of one router: the id the router answers with (its
`X-Millstream-Router` header, drawn at each start: router/api.py), how many restarts that
id showed so far, and the last weight version the trainer told the router.

Invariants:
  * a call that finds the router away (refused or broken connection, no answer within the
    timeout, a 5xx) is retried with backoff for up to `patience_s` (--stall-timeout) from the
    moment the router was first missed, and the wait is said twice: once when it starts
    ("waiting up to N s for the router at URL"), once when the router answers again;
    concurrent calls share that one wait and its two lines. After `patience_s`, or at once
    for a 4xx (a wrong token, a bad request: the same call gets the same answer),
    ServiceUnavailable naming the call. Every call here is idempotent, so a retry after a
    timeout that did land is harmless;
  * `restarts` goes up by one each time the router's id changes: that router forgot its
    workers and its weight version, and the weight sync tells it again (sync.py `readmit`).
    A router that sends no id (another implementation) is never seen to restart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from millstream.common import aio, telemetry
from millstream.common.auth import bearer_headers
from millstream.common.errors import ServiceUnavailable
from millstream.common.fencing import FencedOut

ROUTER_ID_HEADER = "x-millstream-router"  # router/api.py's; no service imports another
FIRST_DELAY_S, MAX_DELAY_S = 0.2, 2.0


def _say(line: str) -> None:
    print(f"[trainer] {line}", flush=True)


class RouterAway(Exception):
    """One attempt found the router away: worth another try."""


class RouterRefused(ServiceUnavailable):
    """The router answered the call with a 4xx: the same call would get the same answer."""


class RouterAdmin:
    def __init__(
        self,
        http: httpx.AsyncClient,
        url: str,
        admin_token: str | None,
        timeout_s: float,
        patience_s: float = 0.0,
        say: Callable[[str], None] = _say,
    ):
        self.http, self.url, self.timeout_s = http, url, timeout_s
        self.patience_s = patience_s
        self.say = say
        self.headers = bearer_headers(admin_token)
        self.router_id: str | None = None
        self.restarts = 0
        self.version_set: str | None = None  # the last version told to this router
        self._away_since: float | None = None  # when a call first missed the router

    async def _call(self, method: str, path: str, *, patient: bool = True, **kwargs: Any) -> Any:
        """The JSON answer; `patient` False: one attempt (a progress probe must not wait)."""
        delay = FIRST_DELAY_S
        while True:
            try:
                return await self._attempt(method, path, **kwargs)
            except RouterAway as away:
                now = time.monotonic()
                if patient and self._away_since is None:
                    self._away_since = now
                    if self.patience_s > 0:
                        self.say(
                            f"waiting up to {self.patience_s:g} s (--stall-timeout) for the "
                            f"router at {self.url}: {method} {path}: {away}"
                        )
                waited = now - self._away_since if patient and self._away_since else 0.0
                if not patient or waited >= self.patience_s:
                    raise ServiceUnavailable(
                        f"router {self.url}: {method} {path} failed ({away}; waited "
                        f"{waited:.0f} s, --stall-timeout {self.patience_s:g}); is the router "
                        "running?"
                    ) from None
                await asyncio.sleep(min(delay, self.patience_s - waited))
                delay = min(2 * delay, MAX_DELAY_S)

    async def _attempt(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = telemetry.inject_headers(dict(self.headers))
        try:
            resp = await aio.wait_for(
                self.http.request(method, self.url + path, headers=headers, **kwargs),
                self.timeout_s,
            )
        except TimeoutError:
            raise RouterAway(f"no answer within {self.timeout_s:g} s") from None
        except httpx.TransportError as err:
            raise RouterAway(f"{type(err).__name__}: {err}") from None
        if resp.status_code >= 500:
            raise RouterAway(f"HTTP {resp.status_code}: {resp.text[:200]}")
        self._answered(resp)
        if resp.status_code == 409 and "fenced" in resp.text:  # common/fencing.py
            raise FencedOut(f"router {self.url}: {method} {path}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise RouterRefused(
                f"router {self.url}: {method} {path} failed (HTTP {resp.status_code}: "
                f"{resp.text[:300]}); is --admin-token right?"
            )
        try:
            return resp.json()
        except ValueError as err:
            raise ServiceUnavailable(
                f"router {self.url}: {method} {path} answered no JSON ({err}): {resp.text[:200]}"
            ) from None

    def _answered(self, resp: httpx.Response) -> None:
        if self._away_since is not None:
            away, self._away_since = time.monotonic() - self._away_since, None
            if self.patience_s > 0:
                self.say(f"the router at {self.url} answers again (away {away:.1f} s)")
        rid = resp.headers.get(ROUTER_ID_HEADER)
        if rid is None:
            return
        if self.router_id is not None and rid != self.router_id:
            self.restarts += 1
        self.router_id = rid

    async def engines(self, *, patient: bool = True) -> list[str]:
        return list((await self._call("GET", "/list_workers", patient=patient))["urls"])

    async def eligible(self) -> list[str] | None:
        """The engines the router would route a request to now; None when it cannot say
        (a router without GET /workers, or whose entries say neither eligibility nor health)."""
        try:
            body = await self._call("GET", "/workers")
        except RouterRefused:
            return None  # no such endpoint here
        workers = body.get("workers") if isinstance(body, dict) else None
        if not isinstance(workers, list):
            return None
        verdicts = [(w.get("url"), w.get("eligible", w.get("is_healthy"))) for w in workers]
        if any(v is None for _, v in verdicts):
            return None
        return [url for url, ok in verdicts if ok]

    async def add(self, url: str) -> None:
        await self._call("POST", "/add_worker", params={"url": url})

    async def remove(self, url: str) -> None:
        await self._call("POST", "/remove_worker", params={"url": url})

    async def set_version(self, version: str, at_version: Sequence[str] = ()) -> list[str]:
        """Serve `version` only; returns the engines the router routes to now. `at_version`:
        engines that confirmed `version` to us, which the router need not ask again."""
        body = await self._call(
            "POST",
            "/set_weight_version",
            json={"weight_version": version, "workers_at_version": list(at_version)},
        )
        self.version_set = version
        return list(body.get("eligible", []))

    async def gate(self, version: str) -> None:
        """Serve `version` only, which no engine holds yet: the router asks none of them."""
        await self._call(
            "POST", "/set_weight_version", json={"weight_version": version, "read_versions": False}
        )
        self.version_set = version
