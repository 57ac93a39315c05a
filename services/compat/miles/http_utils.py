"""Miles' `miles.utils.http_utils`: `post`, `get`, `wait_http_ok` and its port helpers.

`post` is what Miles' plugins reach the engines with (the router's /generate, as SGLang speaks
it). One keep-alive client per process, made on first use; a plugin that runs its own event
loop (Miles' `async_utils.run`, or `asyncio.run` in a thread) gets a client of its own for
that loop, since a connection belongs to the loop that opened it. Miles' Ray-distributed post
(`--use-distributed-post`) has no counterpart: every worker posts from its own process.
`post` adds the caller's trace context and group (common/telemetry.py), so a plugin's
generation shows in its group's trace as millstream's own do.
"""

from __future__ import annotations

import asyncio
import socket
import time
import weakref
from typing import Any

__all__ = [
    "find_available_port",
    "get",
    "is_port_available",
    "post",
    "router_worker_base_urls",
    "wait_http_ok",
]

_HTTP: Any = None  # the process's client (tests may set their own)
_BOUND: tuple[Any, Any] = (None, None)  # (_HTTP, the event loop it belongs to)
_OTHER_LOOPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _new_client() -> Any:
    import httpx

    return httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_keepalive_connections=64))


def _client() -> Any:
    global _HTTP, _BOUND
    loop = asyncio.get_running_loop()
    if _HTTP is None:
        _HTTP = _new_client()
    if _BOUND[0] is not _HTTP:
        _BOUND = (_HTTP, loop)
    if _BOUND[1] is loop:
        return _HTTP
    client = _OTHER_LOOPS.get(loop)
    if client is None:
        client = _OTHER_LOOPS[loop] = _new_client()
    return client


async def aclose() -> None:
    """Close this event loop's client (the next call makes a new one)."""
    global _HTTP
    loop = asyncio.get_running_loop()
    if _HTTP is not None and _BOUND[0] is _HTTP and _BOUND[1] is loop:
        client, _HTTP = _HTTP, None
        await client.aclose()
    other = _OTHER_LOOPS.pop(loop, None)
    if other is not None:
        await other.aclose()


async def post(
    url: str,
    payload: dict[str, Any] | None,
    max_retries: int = 60,
    action: str = "post",
    headers: Any = None,
) -> Any:
    """`action` (post, or get/delete without a payload) and the JSON answer (the text when it
    is not JSON). As Miles' does, any failure, an HTTP error status included (a router
    answering 503 while the engines take new weights), is tried again once a second,
    `max_retries` tries in all, and the last one raises."""
    import httpx

    if max_retries < 1:
        raise ValueError(f"max_retries {max_retries}: must be >= 1")
    if action in ("get", "delete") and payload:
        raise ValueError(f"{action} {url}: a {action} sends no payload")
    from millstream.common.telemetry import group_request_headers

    headers = group_request_headers(headers)
    client = _client()
    for attempt in range(1, max_retries + 1):
        try:
            if action in ("get", "delete"):
                response = await getattr(client, action)(url, headers=headers)
            else:
                response = await getattr(client, action)(url, json=payload or {}, headers=headers)
            response.raise_for_status()
        except httpx.HTTPError:
            if attempt == max_retries:
                raise
            await asyncio.sleep(1)
            continue
        try:
            return response.json()
        except ValueError:
            return response.text
    raise AssertionError("unreachable")


async def get(url: str) -> Any:
    """One GET and its JSON answer; an HTTP error status raises (Miles' get does not retry)."""
    response = await _client().get(url)
    response.raise_for_status()
    return response.json()


async def wait_http_ok(
    url: str, *, json_payload: Any = None, timeout: float = 180.0, request_timeout: float = 60.0
) -> None:
    """Ask `url` every 5 s until it answers 200 (a POST of json_payload when given, else a
    GET); TimeoutError naming the last answer after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    last = "no attempt made"
    async with httpx.AsyncClient() as client:
        while True:
            try:
                if json_payload is not None:
                    response = await client.post(url, json=json_payload, timeout=request_timeout)
                else:
                    response = await client.get(url, timeout=request_timeout)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as err:
                last = repr(err)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready after {timeout}s: {last}")
            await asyncio.sleep(5)


def is_port_available(port: int) -> bool:
    """Whether this host can listen on `port` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
            s.listen(1)
        except (OSError, OverflowError):
            return False
    return True


def find_available_port(base_port: int) -> int:
    """A free port a little above base_port (Miles' walk: up by 42, down by 43 near the top)."""
    import random

    port = base_port + random.randint(100, 1000)
    while not is_port_available(port):
        port = port + 42 if port < 60000 else port - 43
    return port


def router_worker_base_urls(urls: list[str]) -> list[str]:
    """The router's worker URLs without the `@<dp rank>` suffix, each engine once."""
    bases: list[str] = []
    for url in urls:
        base, sep, rank = url.rpartition("@")
        url = base if sep and rank.isdigit() else url
        if url not in bases:
            bases.append(url)
    return bases
