"""Trace context survives every carrier: stream fields, HTTP headers, gRPC metadata; JSONL export."""

from __future__ import annotations

import json
import os
import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from millstream.common import telemetry


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _parent_child(inject, extract) -> None:
    provider, exporter = _provider()
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("producer") as producer:
        carrier = inject()
    with tracer.start_as_current_span("consumer", context=extract(carrier)):
        pass
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["consumer"].parent.span_id == producer.get_span_context().span_id
    assert spans["consumer"].context.trace_id == producer.get_span_context().trace_id


def test_stream_fields_carry_the_parent_even_as_bytes():
    def extract(fields):
        as_bytes = {
            k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()
        }
        return telemetry.context_from_fields(as_bytes)

    _parent_child(lambda: telemetry.inject_fields({"data": b"x"}), extract)


def test_http_headers_carry_the_parent_in_any_case():
    def extract(headers):
        return telemetry.context_from_headers({k.title(): v for k, v in headers.items()})

    _parent_child(telemetry.inject_headers, extract)


def test_grpc_metadata_carries_the_parent():
    _parent_child(telemetry.grpc_metadata, telemetry.context_from_grpc_metadata)


def test_no_context_means_a_new_root():
    provider, exporter = _provider()
    with provider.get_tracer("t").start_as_current_span(
        "root", context=telemetry.context_from_fields({})
    ):
        pass
    assert exporter.get_finished_spans()[0].parent is None


def test_jsonl_export_when_a_run_dir_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    provider = telemetry.make_provider("svc", tmp_path)
    assert provider is not None
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("outer"), tracer.start_as_current_span("inner") as inner:
        inner.set_attribute("group_id", "g1")
    provider.shutdown()
    (path,) = (tmp_path / "traces").glob("svc-*.jsonl")
    spans = {d["name"]: d for d in map(json.loads, path.read_text().splitlines())}
    assert spans["inner"]["parent_span_id"] == spans["outer"]["span_id"]
    assert spans["inner"]["attributes"] == {"group_id": "g1"} and spans["inner"]["service"] == "svc"


def test_span_files_are_named_by_service_host_and_pid(tmp_path, monkeypatch):
    """Two replicas in containers are both pid 1: the host name (the container's) tells their
    files apart; two processes of one host: the pid."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setattr(telemetry.socket, "gethostname", lambda: "9f3a/c0ntainer x")
    provider = telemetry.make_provider("rollout", tmp_path)
    provider.shutdown()
    replica = f"9f3a_c0ntainer_x-{os.getpid()}"
    assert [p.name for p in (tmp_path / "traces").iterdir()] == [f"rollout-{replica}.jsonl"]
    assert provider.resource.attributes["service.instance.id"] == replica


def test_a_request_names_every_group_it_serves_for_links():
    """X-Millstream-Groups round trip: one link and one id per traced group (ids with any
    characters), untraced members left out, malformed items skipped."""
    provider, _ = _provider()
    tracer = provider.get_tracer("t")
    served = []
    for gid in ("e0-i1", "eval,a@b r1"):
        with tracer.start_as_current_span("process", attributes={telemetry.GROUP_ID: gid}):
            served.append(telemetry.current_group())
    untraced = telemetry.current_group()
    assert untraced[0] is None and not untraced[1].is_valid
    header = telemetry.groups_header([*served, untraced])
    headers = {telemetry.GROUPS_HEADER: header + ",junk,@1-2,x@zz-1"}
    attributes, links = telemetry.served_groups(headers)
    assert attributes == {telemetry.GROUP_IDS: ["e0-i1", "eval,a@b r1"]}
    ids = [(link.context.trace_id, link.context.span_id) for link in links]
    assert ids == [(ctx.trace_id, ctx.span_id) for _, ctx in served]
    assert telemetry.served_groups({}) == ({}, [])


def test_a_burst_of_spans_is_exported_whole(tmp_path, monkeypatch):
    """10,000 spans at once (an eval burst): none dropped (the SDK's default queue of 2048
    spans drops most of them)."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    provider = telemetry.make_provider("burst", tmp_path)
    assert provider is not None
    tracer = provider.get_tracer("t")
    for i in range(10_000):
        with tracer.start_as_current_span("group", attributes={"i": i}):
            pass
    provider.shutdown()
    (path,) = (tmp_path / "traces").glob("burst-*.jsonl")
    assert len(path.read_text().splitlines()) == 10_000


def test_no_exporter_without_endpoint_or_run_dir(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert telemetry.make_provider("svc", None) is None


def test_otlp_when_the_endpoint_is_set(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    provider = telemetry.make_provider("svc", None)
    assert provider is not None
    processor = provider._active_span_processor._span_processors[0]
    assert type(processor.span_exporter).__name__ == "PatientExporter"
    assert type(processor.span_exporter.inner).__name__ == "OTLPSpanExporter"
    provider.shutdown()


def test_otlp_to_the_compose_collector_only_when_its_name_resolves(tmp_path, monkeypatch):
    """Compose names its trace viewer in MILLSTREAM_OTLP_ENDPOINT_IF_RESOLVES: a host that
    resolves (here localhost) gets the spans over OTLP as well as the run dir's JSONL files
    (`millstream trace` reads a compose run as a local one); one that does not, the files
    alone."""

    def exporters(provider) -> list[str]:
        processors = provider._active_span_processor._span_processors
        return [type(p.span_exporter).__name__ for p in processors]

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv(telemetry.OTLP_IF_RESOLVES, "http://localhost:4317")
    provider = telemetry.make_provider("svc", tmp_path)
    assert exporters(provider) == ["PatientExporter", "JsonlSpanExporter"]
    provider.shutdown()
    monkeypatch.setenv(telemetry.OTLP_IF_RESOLVES, "http://no-such-host.invalid:4317")
    provider = telemetry.make_provider("svc", tmp_path)
    assert exporters(provider) == ["JsonlSpanExporter"]
    provider.shutdown()


def test_a_span_of_many_groups_is_mirrored_into_each_groups_trace():
    """A train step serves many groups: a viewer shows one trace at a time, so each linked
    group's trace gets a copy (same name, times, stage; a link back), which the CLI skips."""
    provider, exporter = _provider()
    tracer = provider.get_tracer("t")
    groups = []
    for gid in ("g0", "g1"):
        with tracer.start_as_current_span(f"wait {gid}") as wait:
            groups.append(wait.get_span_context())
    links = [trace.Link(c) for c in groups]
    attributes = {telemetry.STAGE: "train_step"}
    with tracer.start_as_current_span("trainer.step", links=links, attributes=attributes) as step:
        pass
    telemetry.mirror(tracer, step, links)
    copies = [s for s in exporter.get_finished_spans() if telemetry.MIRROR_OF in s.attributes]
    assert [c.parent.span_id for c in copies] == [g.span_id for g in groups]
    assert [c.context.trace_id for c in copies] == [g.trace_id for g in groups]
    for c in copies:
        assert (c.name, c.start_time, c.end_time) == (
            "trainer.step",
            step.start_time,
            step.end_time,
        )
        assert c.attributes[telemetry.STAGE] == "train_step"
        assert c.links[0].context.span_id == step.get_span_context().span_id
    telemetry.mirror(tracer, trace.INVALID_SPAN, links)  # the no-op tracer's: nothing
    assert len(exporter.get_finished_spans()) == 5


def test_a_queue_wait_is_a_span_from_the_entry_time_to_now():
    provider, exporter = _provider()
    tracer = provider.get_tracer("t")
    since = time.time_ns() - 250_000_000
    telemetry.wait_span(
        tracer, "r:prompts", "prompts_wait", since, None, {"millstream.group_id": "g"}
    )
    (span,) = exporter.get_finished_spans()
    assert span.name == "wait r:prompts" and span.start_time == since
    assert 0.25 <= (span.end_time - span.start_time) / 1e9 < 5
    assert span.attributes[telemetry.STAGE] == "prompts_wait"
    assert span.attributes["messaging.destination.name"] == "r:prompts"
    assert telemetry.entry_time_ns("1700000000123-4") == 1_700_000_000_123_000_000
    # Redis' clock ahead of ours: the span never starts after it ends.
    telemetry.wait_span(tracer, "s", "prompts_wait", time.time_ns() + 10**9)
    assert (
        exporter.get_finished_spans()[-1].start_time <= exporter.get_finished_spans()[-1].end_time
    )


def test_a_batched_requests_span_is_mirrored_into_the_other_groups_traces_only():
    """The router's and engine's span of a batch is the first group's child and links to every
    group it serves (X-Millstream-Groups): the copies go to the other groups' traces."""
    provider, exporter = _provider()
    tracer = provider.get_tracer("t")
    groups = []
    for gid in ("g0", "g1", "g2"):
        with tracer.start_as_current_span(f"rollout {gid}") as rollout:
            groups.append(rollout.get_span_context())
    parent = trace.set_span_in_context(trace.NonRecordingSpan(groups[0]))
    links = [trace.Link(c) for c in groups]
    with tracer.start_as_current_span("router.proxy", context=parent, links=links) as span:
        pass
    telemetry.mirror(tracer, span)  # its own links
    copies = [s for s in exporter.get_finished_spans() if telemetry.MIRROR_OF in s.attributes]
    assert [c.context.trace_id for c in copies] == [groups[1].trace_id, groups[2].trace_id]
