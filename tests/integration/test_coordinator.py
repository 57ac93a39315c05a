"""The Coordinator gRPC service over a real loopback port, with a real redis-server.

GetVersion answers the published version; WatchVersion streams the current one, then each
published version in order; JoinEngine records a pending join the trainer takes once; the
version lands in `{run}:version`; every RPC's span is a child of the caller's trace context.
With an admin token, JoinEngine needs it (UNAUTHENTICATED otherwise, nothing recorded), and a
real engine given the same --admin-token joins.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from millstream.common.errors import ServiceUnavailable
from millstream.common.keys import RunKeys
from millstream.common.pb import services_pb2, services_pb2_grpc
from millstream.engine.http.registration import join
from millstream.trainer.weights.coordinator import Coordinator
from tests.support.engine_proc import EngineProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

RUN = "coord-run"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACE = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN}-01"),)
TOKEN = "co0rd-s3cret"


def serve(
    body: Callable[[Coordinator, services_pb2_grpc.CoordinatorStub], Awaitable[Any]],
    *,
    redis_url: str | None = None,
    version: int = 0,
    tracer: Any = None,
    admin_token: str | None = None,
) -> Any:
    """Run `body(coordinator, stub)` against a coordinator serving on a free port."""

    async def main() -> Any:
        redis = None
        if redis_url is not None:
            from millstream.common.redis_conn import connect

            redis = await connect(redis_url)
        coordinator = Coordinator(
            RUN, version=version, redis=redis, tracer=tracer, admin_token=admin_token
        )
        port = await coordinator.start(0)
        assert port > 0
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(coordinator, services_pb2_grpc.CoordinatorStub(channel))
        finally:
            await coordinator.stop()
            if redis is not None:
                await redis.aclose()

    return asyncio.run(main())


def test_get_version_and_redis_follow_every_publish(redis_url: str):
    async def body(coordinator: Coordinator, stub: services_pb2_grpc.CoordinatorStub):
        first = await stub.GetVersion(services_pb2.GetVersionRequest())
        assert (first.version, first.run_id) == (3, RUN) and first.updated_unix > 0
        await coordinator.publish_version(4)
        coordinator.publish_version(5)  # not awaited: stop() finishes the write
        second = await stub.GetVersion(services_pb2.GetVersionRequest())
        assert second.version == 5 and second.updated_unix >= first.updated_unix
        with pytest.raises(ValueError, match="never goes down"):
            coordinator.publish_version(2)

    serve(body, redis_url=redis_url, version=3)
    import redis

    client = redis.Redis.from_url(redis_url)
    assert client.get(RunKeys(RUN).version) == b"5"
    client.close()


def test_watch_version_streams_the_current_one_then_each_publish_in_order():
    def watch(stub: services_pb2_grpc.CoordinatorStub, after: int) -> Any:
        return stub.WatchVersion(services_pb2.WatchVersionRequest(after_version=after))

    async def body(coordinator: Coordinator, stub: services_pb2_grpc.CoordinatorStub):
        every = watch(stub, -1)
        assert (await every.read()).version == 0  # the current one at once
        for version in (1, 2, 3, 3, 4):  # the same version again is no news
            coordinator.publish_version(version)
        assert [(await every.read()).version for _ in range(4)] == [1, 2, 3, 4]
        late = watch(stub, 2)  # behind: the current one at once
        assert (await late.read()).version == 4
        ahead = watch(stub, 5)  # ahead: nothing until a version beyond it
        coordinator.publish_version(5)
        coordinator.publish_version(6)
        assert (await ahead.read()).version == 6
        assert [(await every.read()).version for _ in range(2)] == [5, 6]
        assert (await late.read()).version in (5, 6)
        for call in (every, late, ahead):
            call.cancel()

    serve(body)


def test_join_engine_records_a_pending_join_taken_once():
    async def body(coordinator: Coordinator, stub: services_pb2_grpc.CoordinatorStub):
        url = "http://10.0.0.7:30000"
        answer = await stub.JoinEngine(services_pb2.JoinEngineRequest(engine_url=url + "/"))
        assert answer.accepted and answer.version == 7
        assert "next weight sync" in answer.message
        await stub.JoinEngine(services_pb2.JoinEngineRequest(engine_url=url))  # asked twice
        assert coordinator.take_pending_joins() == [url]
        assert coordinator.take_pending_joins() == []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.JoinEngine(services_pb2.JoinEngineRequest(engine_url="not a url"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "engine_url" in (err.value.details() or "")
        assert coordinator.take_pending_joins() == []

    serve(body, version=7)


def test_every_rpc_span_is_a_child_of_the_callers_trace_context():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def body(coordinator: Coordinator, stub: services_pb2_grpc.CoordinatorStub):
        await stub.GetVersion(services_pb2.GetVersionRequest(), metadata=TRACE)
        request = services_pb2.JoinEngineRequest(engine_url="http://127.0.0.1:1")
        await stub.JoinEngine(request, metadata=TRACE)
        watch = stub.WatchVersion(
            services_pb2.WatchVersionRequest(after_version=-1), metadata=TRACE
        )
        assert (await watch.read()).version == 0
        watch.cancel()

    serve(body, tracer=provider.get_tracer("test"))
    provider.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "millstream.v1.Coordinator/GetVersion",
        "millstream.v1.Coordinator/JoinEngine",
        "millstream.v1.Coordinator/WatchVersion",
    }
    for span in spans.values():
        assert f"{span.context.trace_id:032x}" == TRACE_ID
        assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_SPAN


def test_join_engine_needs_the_admin_token_when_one_is_set():
    url = "http://10.0.0.8:30000"
    request = services_pb2.JoinEngineRequest(engine_url=url)

    async def body(coordinator: Coordinator, stub: services_pb2_grpc.CoordinatorStub):
        refused = [(), (("authorization", "Bearer n0pe"),), (("authorization", TOKEN),)]
        for metadata in refused:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.JoinEngine(request, metadata=[*TRACE, *metadata])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            details = err.value.details() or ""
            assert "admin token" in details and "--admin-token" in details
            assert "n0pe" not in details and TOKEN not in details
        assert coordinator.take_pending_joins() == []
        assert (await stub.GetVersion(services_pb2.GetVersionRequest())).version == 0  # open
        auth = (("authorization", f"Bearer {TOKEN}"),)
        answer = await stub.JoinEngine(request, metadata=auth)
        assert answer.accepted
        assert coordinator.take_pending_joins() == [url]

    serve(body, admin_token=TOKEN)


@pytest.mark.timeout(120)
def test_an_engine_with_the_token_joins_and_a_wrong_token_is_refused_at_once(
    tiny_model_dir: Path, tmp_path: Path
):
    async def main() -> None:
        coordinator = Coordinator(RUN, admin_token=TOKEN)
        address = f"127.0.0.1:{await coordinator.start(0)}"
        try:
            start = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="UNAUTHENTICATED") as err:
                await join(address, "http://127.0.0.1:1", "n0pe", timeout_s=60)
            assert time.monotonic() - start < 10  # not retried until the timeout
            assert "n0pe" not in str(err.value)

            args = ("--coordinator", address, "--admin-token", TOKEN)
            engine = await asyncio.to_thread(EngineProcess, tiny_model_dir, tmp_path, *args)
            try:
                deadline = time.monotonic() + 30
                while not (joins := coordinator.take_pending_joins()):
                    assert time.monotonic() < deadline, engine.log_tail()
                    await asyncio.sleep(0.1)
                assert joins == [engine.url]
            finally:
                assert await asyncio.to_thread(engine.stop) == 0
        finally:
            await coordinator.stop()

    asyncio.run(main())
