"""One HTTP client per process: httpx over a connection pool with O(1) bookkeeping.

Used by the router (to its engines) and the rollout worker (to the router): every request
of a rollout goes through both, so each hop's per-request cost counts twice.

Why not httpx's default pool: on every request start and end, httpcore's pool walks every
connection it holds (a readability poll per idle one, and an idle count per idle one), so its
cost per request grows with the square of the connections in use. At 32 requests in flight that
walk was most of the router's CPU (bench/bench_router.py, profiled); in the rollout worker it
was the top of the profile, and httpx's default of 20 kept-alive connections made every request
beyond 20 in flight open (and the router accept) a new one. Here each origin keeps a stack of
idle connections: checkout pops one (dropping any the server closed or that outlived the
keep-alive expiry), release pushes it back. Everything else stays httpx's and httpcore's: one
`httpcore.AsyncHTTPConnection` per socket does the HTTP/1.1, connect/read timeouts and body
streaming; httpx maps errors to its exception types.

Every HTTP client of millstream is made here (`make_client`), also the short-lived ones: a
client with httpx's defaults loads the CA store at construction (~0.4 s of CPU on 2 cores),
where this one loads it once per process, at its first https connection.

Invariant: a connection is in exactly one place: serving one request, in its origin's idle
stack, or closed. At most `max_idle_per_origin` idle connections are kept per origin.
"""

from __future__ import annotations

import functools
import socket
import ssl
from collections import defaultdict, deque
from collections.abc import AsyncIterator

import httpcore
import httpx

# Below uvicorn's default keep-alive (5 s), so we drop an idle connection before the server
# does, instead of racing it with a request (that would read as a broken worker).
KEEPALIVE_EXPIRY_S = 4.0
MAX_IDLE_PER_ORIGIN = 256

# TCP keepalive on every connection: after 10 s without a byte the kernel probes the peer
# every 5 s and gives up after 6 unanswered probes. Across a network partition nothing refuses
# or resets: a request waiting for its answer ends 40 s into the silence (a connection error,
# which the router retries elsewhere and the rollout client retries), or, when the peer's
# socket died in the silence (its answer, its FIN and its retransmissions all lost), with the
# peer's RST at the first probe after the heal; without this it waited out the request's own
# timeout (the router's: 600 s; make chaos-net's only-engine scenario stalled on one). A live
# peer's kernel answers the probes, however long its answer takes to compute.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 6
SOCKET_OPTIONS = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    *(
        (socket.IPPROTO_TCP, getattr(socket, name), value)
        for name, value in (
            ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
            ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        )
        if hasattr(socket, name)  # Linux; elsewhere the system's keepalive timing
    ),
]


class _Released:
    """The response body; closing it hands the connection back to the pool."""

    def __init__(self, stream, conn: httpcore.AsyncHTTPConnection, origin, pool: StackPool):
        self._stream, self._conn, self._origin, self._pool = stream, conn, origin, pool
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            if hasattr(self._stream, "aclose"):
                await self._stream.aclose()
        finally:
            await self._pool.release(self._conn, self._origin)


class StackPool:
    """Duck-types httpcore's AsyncConnectionPool for httpx.AsyncHTTPTransport."""

    def __init__(
        self,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_S,
        max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
    ):
        self.keepalive_expiry = keepalive_expiry
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: defaultdict[httpcore.Origin, deque[httpcore.AsyncHTTPConnection]] = defaultdict(
            deque
        )
        self.opened = 0  # connections opened so far (tests and curiosity)

    @staticmethod
    def _key(origin: httpcore.Origin) -> tuple:
        return (origin.scheme, origin.host, origin.port)

    async def _checkout(self, origin: httpcore.Origin) -> httpcore.AsyncHTTPConnection:
        stack = self._idle[self._key(origin)]
        while stack:
            conn = stack.pop()
            if conn.is_idle() and not conn.has_expired():
                return conn
            await conn.aclose()  # closed by the server, or past its keep-alive expiry
        self.opened += 1
        tls = tls_context() if origin.scheme == b"https" else None
        return httpcore.AsyncHTTPConnection(
            origin=origin,
            keepalive_expiry=self.keepalive_expiry,
            ssl_context=tls,
            socket_options=SOCKET_OPTIONS,
        )

    async def release(self, conn: httpcore.AsyncHTTPConnection, origin: httpcore.Origin) -> None:
        if not conn.is_idle():
            await conn.aclose()  # the response was not read to its end, or said `close`
            return
        stack = self._idle[self._key(origin)]
        stack.append(conn)
        if len(stack) > self.max_idle_per_origin:
            await stack.popleft().aclose()
        elif len(stack) > 1 and stack[0].has_expired():
            await stack.popleft().aclose()  # prune one stale connection per release

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        origin = request.url.origin
        conn = await self._checkout(origin)
        try:
            response = await conn.handle_async_request(request)
        except BaseException:
            await conn.aclose()
            raise
        return httpcore.Response(
            status=response.status,
            headers=response.headers,
            content=_Released(response.stream, conn, origin, self),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        for stack in self._idle.values():
            while stack:
                await stack.pop().aclose()

    async def __aenter__(self) -> StackPool:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()


class StackPoolTransport(httpx.AsyncHTTPTransport):
    """httpx's transport (request/response conversion, error mapping) on a StackPool."""

    def __init__(self, pool: StackPool | None = None):
        # verify=False only spares building the CA store for httpx's own pool, which is
        # replaced at once; our connections verify with tls_context().
        super().__init__(verify=False)
        self._pool = pool or StackPool()  # type: ignore[assignment]


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's TLS context (httpx's default: certifi, or $SSL_CERT_FILE), built at the
    first https connection: loading the CA store costs ~0.4 s of CPU here, paid by every
    client made with httpx's defaults, at every service's start, for loopback HTTP."""
    return httpx.create_ssl_context()


def make_client(
    timeout: httpx.Timeout, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """A process's one shared client; `transport` replaces the socket pool in tests."""
    return httpx.AsyncClient(
        transport=transport or StackPoolTransport(), timeout=timeout, follow_redirects=False
    )
