"""Spans reach an OTLP collector that starts late or answers "at capacity" (issue 42: compose
started the services before Phoenix listened; 576 of 5760 groups had no span in it).

A real gRPC OTLP collector (opentelemetry-proto's TraceService) in this process, the services'
own exporter (telemetry.make_provider) with its per-try timeout cut to 1 s: before
PatientExporter, a collector 3 s late lost every span sent before it listened."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from millstream.common import telemetry
from tests.support.redis_server import free_port

pytestmark = pytest.mark.integration

SPANS = 300


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps the span ids it takes; answers UNAVAILABLE "at capacity" (as Phoenix does when
    its queue is full) to the first `busy` requests."""

    def __init__(self, busy: int = 0):
        self.busy = busy
        self.requests = 0
        self.span_ids: set[bytes] = set()
        self.lock = threading.Lock()

    def Export(self, request, context):  # gRPC names the method
        with self.lock:
            self.requests += 1
            if self.requests <= self.busy:
                context.abort(grpc.StatusCode.UNAVAILABLE, "Server is at capacity")
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.span_ids.update(span.span_id for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def serve(collector: Collector, port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def make_spans(monkeypatch, port: int) -> tuple[object, set[int]]:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # the exporter's own retries: 1 s
    monkeypatch.setenv("MILLSTREAM_OTLP_PATIENCE_S", "30")
    provider = telemetry.make_provider("svc", None)
    tracer = provider.get_tracer("t")
    ids = set()
    for i in range(SPANS):
        with tracer.start_as_current_span("group", attributes={"i": i}) as span:
            ids.add(span.get_span_context().span_id)
    return provider, ids


def wait_for(collector: Collector, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(collector.span_ids) < n and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_a_collector_that_starts_late_gets_every_span(monkeypatch):
    port = free_port()
    collector = Collector()
    provider, ids = make_spans(monkeypatch, port)
    time.sleep(3.0)  # three times the exporter's own timeout: nothing listens yet
    server = serve(collector, port)
    try:
        wait_for(collector, SPANS)
        telemetry.shutdown_tracing(provider)
    finally:
        server.stop(0)
    got = {int.from_bytes(b, "big") for b in collector.span_ids}
    assert got == ids, f"{len(ids - got)} of {SPANS} spans lost"


@pytest.mark.timeout(60)
def test_a_busy_collector_gets_every_span_once_it_takes_them(monkeypatch):
    port = free_port()
    collector = Collector(busy=6)
    server = serve(collector, port)
    try:
        provider, ids = make_spans(monkeypatch, port)
        wait_for(collector, SPANS)
        telemetry.shutdown_tracing(provider)
    finally:
        server.stop(0)
    assert collector.requests > 6
    assert {int.from_bytes(b, "big") for b in collector.span_ids} == ids


@pytest.mark.timeout(30)
def test_shutdown_with_no_collector_ends_promptly_and_counts_the_loss(monkeypatch):
    """Patience is for a running service: at shutdown the batches left get
    MILLSTREAM_OTLP_SHUTDOWN_S in all, then the spans are counted as dropped: the process
    exits."""
    monkeypatch.setenv("MILLSTREAM_OTLP_SHUTDOWN_S", "3")
    provider, _ = make_spans(monkeypatch, free_port())
    time.sleep(1.5)  # the first batch has been refused once: an outage is under way
    started = time.monotonic()
    telemetry.shutdown_tracing(provider)
    (processor,) = provider._active_span_processor._span_processors
    assert time.monotonic() - started < 10
    assert processor.span_exporter.dropped == SPANS
