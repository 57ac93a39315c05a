"""The router's connection pool against a real keep-alive HTTP/1.1 server on loopback."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Awaitable, Callable

import httpcore
import httpx
import pytest

from millstream.common.http_pool import StackPool, StackPoolTransport, make_client, tls_context


class Server:
    """A minimal HTTP/1.1 server: keep-alive, Content-Length bodies, `/close` says close,
    `/big` sends a body large enough to be read in several chunks."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while line := await reader.readline():
                path = line.split()[1].decode()
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                payload = b"x" * 1_000_000 if path == "/big" else path.encode() + b":" + body
                close = path == "/close"
                head = f"HTTP/1.1 200 OK\r\ncontent-length: {len(payload)}\r\n"
                head += "connection: close\r\n" if close else ""
                writer.write(head.encode() + b"\r\n" + payload)
                await writer.drain()
                if close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def run(test: Callable[[Server, httpx.AsyncClient, StackPool], Awaitable[None]], **pool_kw) -> None:
    async def main() -> None:
        pool = StackPool(**pool_kw)
        async with (
            Server() as server,
            httpx.AsyncClient(transport=StackPoolTransport(pool)) as client,
        ):
            await test(server, client, pool)

    asyncio.run(main())


def test_sequential_requests_reuse_one_connection():
    async def check(server, client, pool):
        for i in range(5):
            r = await client.post(server.url + "/echo", content=f"body{i}".encode())
            assert r.status_code == 200 and r.content == f"/echo:body{i}".encode()
        assert server.connections == 1 and pool.opened == 1

    run(check)


def test_concurrent_requests_open_connections_that_all_go_back_idle():
    async def check(server, client, pool):
        rs = await asyncio.gather(*(client.get(f"{server.url}/r{i}") for i in range(20)))
        assert [r.content for r in rs] == [f"/r{i}:".encode() for i in range(20)]
        opened = pool.opened
        assert 1 < opened <= 20
        await asyncio.gather(*(client.get(f"{server.url}/again{i}") for i in range(opened)))
        assert pool.opened == opened  # every connection was reused, none leaked

    run(check)


def test_idle_connections_are_bounded_per_origin():
    async def check(server, client, pool):
        await asyncio.gather(*(client.get(f"{server.url}/r{i}") for i in range(10)))
        assert sum(len(stack) for stack in pool._idle.values()) <= 3

    run(check, max_idle_per_origin=3)


def test_a_connection_the_server_closes_is_not_reused():
    async def check(server, client, pool):
        await client.get(server.url + "/close")
        await client.get(server.url + "/echo")
        assert server.connections == 2 and pool.opened == 2

    run(check)


def test_expired_and_half_read_connections_are_dropped():
    async def check(server, client, pool):
        await client.get(server.url + "/a")
        await asyncio.sleep(0.15)  # past the keep-alive expiry
        await client.get(server.url + "/b")
        assert pool.opened == 2
        async with client.stream("GET", server.url + "/big") as r:
            await anext(r.aiter_raw())  # read a little, then close mid-body
        r = await client.get(server.url + "/c")
        assert r.content == b"/c:" and pool.opened == 3  # the half-read one was closed

    run(check, keepalive_expiry=0.1)


@pytest.mark.skipif(sys.platform != "linux", reason="TCP_KEEPIDLE and friends are Linux's")
def test_every_connection_probes_a_silent_peer_after_10_s():
    """TCP keepalive (10 s idle, then a probe every 5 s, 6 of them): a request whose peer's
    socket vanished in a network partition ends at the next probe (the peer's RST), or 40 s
    into the silence, not at the request's own timeout (tests/chaos/net)."""

    async def check(server, client, pool):
        await client.get(server.url + "/a")
        (stack,) = pool._idle.values()
        sock = stack[0]._connection._network_stream.get_extra_info("socket")
        options = {
            "SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "TCP_KEEPIDLE": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "TCP_KEEPINTVL": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "TCP_KEEPCNT": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
        }
        assert options == {
            "SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 6
        }  # fmt: skip

    run(check)


def test_connect_errors_are_httpx_errors():
    async def main() -> None:
        async with Server() as server:
            url = server.url
        async with httpx.AsyncClient(transport=StackPoolTransport()) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(url + "/x")

    asyncio.run(main())


def test_plain_http_never_builds_the_tls_context_and_https_builds_it_once():
    """Loading the CA store is ~0.4 s of CPU: a service talking plain HTTP on loopback must
    not pay it at start-up (httpx's defaults do, per client)."""
    tls_context.cache_clear()

    async def go() -> None:
        async with Server() as server, make_client(httpx.Timeout(5.0)) as client:
            assert (await client.get(server.url + "/x")).status_code == 200
        assert tls_context.cache_info().currsize == 0
        pool = StackPool()
        urls = ("https://a.test:1", "https://b.test:2")
        conns = [await pool._checkout(httpcore.URL(u).origin) for u in urls]
        assert all(c._ssl_context is tls_context() for c in conns)
        assert tls_context.cache_info().misses == 1

    asyncio.run(go())
