"""Every blocking call across a service boundary has a deadline (docs/operations.md, "Every
call has a deadline"): each row of that table is driven here, by the real client code, against
a silent peer, and must give up within its bound.

A silent peer is what a partition looks like from one side: a socket that listens (the kernel
completes the TCP handshake into its backlog) and never reads or answers, so nothing is refused
and nothing is reset. A call without a bound waits here until pytest's timeout fails the test.
The bounds are set small where a flag sets them; the fixed ones are checked at their value.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
SLACK_S = 3.0  # scheduling on a loaded 2-core machine


@pytest.fixture
def silent() -> Iterator[str]:
    """host:port of a peer that accepts connections in its backlog and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


async def _router_admin(peer: str) -> None:
    import httpx

    from millstream.trainer.weights.router_admin import RouterAdmin

    async with httpx.AsyncClient() as http:
        await RouterAdmin(http, f"http://{peer}", None, timeout_s=1.0).engines(patient=False)


async def _engine_admin(peer: str) -> None:
    import httpx

    from millstream.trainer.weights.calls import EngineCalls

    async with httpx.AsyncClient() as http:
        await EngineCalls(http, 1.0, None).post(f"http://{peer}", "/pause_generation", {})


async def _update_group(peer: str) -> None:
    from millstream.trainer.weights.routes.process_group import UpdateGroup

    # Rank 0 waits for engines that never join (one partitioned away).
    group = UpdateGroup("deadline", 2, "gloo", "127.0.0.1", timeout_s=2.0)
    await asyncio.to_thread(group.join)


async def _join_engine(peer: str) -> None:
    from millstream.engine.http.registration import join

    await join(peer, "http://127.0.0.1:1", timeout_s=1.0)


async def _register(peer: str) -> None:
    from millstream.engine.http.registration import register

    await register(f"http://{peer}", "http://127.0.0.1:1", None, attempts=1)


async def _generate(peer: str) -> None:
    from millstream.common.retry import Backoff
    from millstream.rollout.client import RouterClient

    client = RouterClient(
        f"http://{peer}", max_concurrency=1, retry=Backoff(attempts=1), timeout_s=1.0
    )
    try:
        await client.generate([65, 66], {"max_new_tokens": 1}, "deadline")
    finally:
        await client.aclose()


async def _health_check(peer: str) -> None:
    import httpx

    from millstream.router.health import HealthChecker
    from millstream.router.registry import Registry

    async with httpx.AsyncClient() as http:
        checker = HealthChecker(Registry(1, 1), http, interval=1.0, timeout=1.0)
        assert not await checker.answers(f"http://{peer}")
        raise TimeoutError("no answer")  # answers() says False; the row is its bound


async def _remote_rm(peer: str) -> None:
    from millstream.common.types import Sample
    from millstream.reward.remote_rm import RemoteRM

    rm = RemoteRM(f"http://{peer}/score", timeout_s=1.0)
    try:
        await rm(Sample(), "1+1=", "2")
    finally:
        await rm.aclose()


async def _teacher(peer: str) -> None:
    from millstream.trainer.backends.base import TrainSample
    from millstream.trainer.teacher import TeacherClient

    teacher = TeacherClient(f"http://{peer}", 1.0, timeout_s=1.0)
    sample = TrainSample(
        tokens=[65, 66, 67], prompt_len=2, loss_mask=[1], rollout_logprobs=[0.0], reward=0.0
    )
    await teacher.score([sample])


async def _redis(peer: str) -> None:
    from millstream.common.redis_conn import connect

    await connect(f"redis://{peer}/0")  # its PING: redis-py's 5 s socket timeout


async def _span_export(peer: str) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExportResult

    with TracerProvider().get_tracer("deadline").start_as_current_span("one") as span:
        pass
    # As common/telemetry.py makes it: the exporter's own timeout (10 s) bounds one export
    # with its retries; PatientExporter bounds the batch's tries by MILLSTREAM_OTLP_PATIENCE_S.
    exporter = OTLPSpanExporter(endpoint=f"http://{peer}/v1/traces")
    result = await asyncio.to_thread(exporter.export, [span])
    assert result is SpanExportResult.FAILURE
    raise TimeoutError("exported nothing")


# The table's call -> (the call against the silent peer, its bound in seconds here).
ROWS: dict[str, tuple[Callable[[str], Awaitable[None]], float]] = {
    "trainer -> router admin calls": (_router_admin, 1.0),
    "trainer -> engine admin calls": (_engine_admin, 1.0),
    "weight sync: update-group rendezvous and collectives": (_update_group, 2.0),
    "engine -> trainer Coordinator (JoinEngine, gRPC)": (_join_engine, 1.0 + 5.0),
    "engine -> router registration": (_register, 10.0),
    "rollout worker -> router /generate": (_generate, 1.0),
    "router -> engine health check": (_health_check, 1.0),
    "reward worker -> remote RM": (_remote_rm, 1.0),
    "trainer -> OPD teacher engine": (_teacher, 1.0),
    "any Redis command (one attempt)": (_redis, 5.0),
    "span export (OTLP)": (_span_export, 10.0),
}


@pytest.mark.parametrize("call", sorted(ROWS))
def test_a_call_to_a_silent_peer_gives_up_within_its_bound(call: str, silent: str):
    attempt, bound = ROWS[call]
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 (each client says it in its own words)
        asyncio.run(asyncio.wait_for(attempt(silent), timeout=bound + 60))
    took = time.monotonic() - start
    assert took <= bound + SLACK_S, f"{call}: gave up after {took:.1f} s, bound {bound} s"


def test_the_docs_table_lists_exactly_the_calls_tested_here():
    text = (REPO / "docs" / "operations.md").read_text()
    section = text.split("### Every call has a deadline", 1)[1].split("\n#", 1)[0]
    calls = {m.group(1).strip() for m in re.finditer(r"^\| ([^|]+?) \|", section, re.M)}
    calls -= {"call", "---"}
    assert calls == set(ROWS), (calls - set(ROWS), set(ROWS) - calls)
