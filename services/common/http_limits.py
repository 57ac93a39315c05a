"""A request body size limit for the router and the engine (`--max-request-bytes`), as ASGI
middleware in front of everything else.

Invariants: the app never reads more than `max_bytes` of one request's body. A declared
Content-Length over the limit is answered 413 before the app runs or a byte of the body is
read. A body without one (chunked) is counted as it arrives: the chunk that crosses the limit
makes the app's `receive` raise, the app's own answer to the cut-off body is dropped, and the
413 goes out in its place (had the app already started its response, the connection is cut
instead). Every 413 says `Connection: close`, so the server does not read the rest of the
upload, and the process goes on serving other connections.

What the limit must admit: our HTTP bodies are JSON. Weight sync moves tensors over NCCL or
gloo, so its HTTP calls are small; the largest legitimate bodies are long prompts as token
ids (a 128k-token prompt is under 1 MB of JSON) and `/update_weights_from_tensor` of small
models; the default (32 MiB) leaves room for both. Nothing here imports Starlette: the error
response is the service's own (`error_response(status, message)`, an ASGI response).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("millstream.http")

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024**2


class BodyTooLarge(Exception):
    """Raised by the counted `receive` once the body crosses the limit."""


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length itself
    return None


class BodyLimit:
    """ASGI middleware: 413 for a request body over `max_bytes` (module docstring).
    `error_response(status, message)` makes the service's own error (an ASGI response);
    `flag` names the setting in the message."""

    def __init__(
        self, app: Any, max_bytes: int, error_response: Callable[[int, str], Any], flag: str
    ):
        self.app, self.max_bytes = app, max_bytes
        self.error_response, self.flag = error_response, flag

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, f"request body of {declared} bytes is")
            return
        seen, over, started = 0, False, False

        async def counted() -> dict[str, Any]:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise BodyTooLarge(f"request body over {self.max_bytes} bytes")
            return message

        async def guarded(message: dict[str, Any]) -> None:
            nonlocal started
            if over and not started:
                return  # the app's answer to a body we cut off: the 413 replaces it
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over or started:
                raise
        if over and not started:
            await self._refuse(scope, receive, send, f"chunked request body reached {seen} bytes,")

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any, what: str) -> None:
        message = f"{what} over the limit of {self.max_bytes} bytes ({self.flag})"
        log.warning("%s %s: 413, %s", scope.get("method"), scope.get("path"), message)
        response = self.error_response(413, message)
        response.headers["connection"] = "close"
        await response(scope, receive, send)
