"""Tracing for every service: one trace per prompt group, across processes (docs/observability.md).

Where spans go, decided once per process from the environment by `setup_tracing`:
  1. OTLP (gRPC) when OTEL_EXPORTER_OTLP_ENDPOINT is set, or MILLSTREAM_OTLP_ENDPOINT_IF_RESOLVES
     is and its host resolves (compose: the trace viewer at `otlp`, when a viewer's profile is on);
  2. else JSONL files under `{run_dir}/traces/` when a run dir is given: one file per process,
     `<service>-<replica>.jsonl` (`replica_name`), one span per line; `millstream trace` reads
     them;
  3. else nothing: the no-op tracer, zero cost (also whenever OTEL_SDK_DISABLED=true).
With both an endpoint and a run dir, spans go to both: `millstream trace` then reads a compose
run as it reads a local one, while the viewer shows it too. A collector that does not listen
yet (compose starts the services before the viewer is up) or is busy (Phoenix answers
UNAVAILABLE "at capacity") loses no span: a batch it refuses is sent again for up to
MILLSTREAM_OTLP_PATIENCE_S (default 120 s; `PatientExporter`) while the queue (SPAN_QUEUE)
holds the spans made meanwhile; at shutdown the batches left get MILLSTREAM_OTLP_SHUTDOWN_S
(15 s) in all, then what is left is counted and said.

Context crosses process boundaries as W3C trace context (`traceparent`/`tracestate`) in three
carriers: stream entry fields, HTTP headers and gRPC metadata. Nothing here runs at import.

A request that serves several groups: the rollout worker sends one `/generate` for the groups
of a claim (rollout/client.py), and W3C context names one parent, so its router and engine
spans belong to the first group's trace alone. The request therefore also names every group
it serves in `X-Millstream-Groups` (`groups_header`: each group's id and the context of its
rollout span), which the router forwards unchanged; the router's and engine's spans record
them (`served_groups`) as `millstream.group_ids` and as one span link per group, so each
group's trace reaches them (`millstream trace` counts such a span in every group it names;
Jaeger and Phoenix show a link as a reference). Our own header, not W3C `tracestate` (32
vendor entries at most, and a hop may cut it to 512 characters) nor baggage (which
propagators pass on to every later call): a batch names up to 64 groups, a few KB.

Every span of a group's lifecycle carries `millstream.stage` (one of STAGES), the name
`millstream trace` groups by; span names and the other attributes follow OpenTelemetry's
semantic conventions (messaging for the streams, HTTP, RPC, GenAI for a generation). Time a
group spends in a stream is a span of its own (`wait_span`): from the entry's XADD (its id is
Redis' clock in ms) to the moment a consumer takes it, so a waterfall shows where it waited.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .span_export import JsonlSpanExporter, PatientExporter

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_FIELDS = ("traceparent", "tracestate")

STAGE = "millstream.stage"
GROUP_ID = "millstream.group_id"
GROUP_IDS = "millstream.group_ids"  # every group a shared request serves (module docstring)
MIRROR_OF = "millstream.mirror_of"  # a copy of a shared span in one group's trace (`mirror`)
GROUPS_HEADER = "x-millstream-groups"
# A group's stages in lifecycle order, then the trainer's per-iteration ones.
STAGES = (
    "admit", "prompts_wait", "rollout", "router", "engine", "generated_wait", "reward",
    "reward_task", "buffer_wait", "train_step", "weight_sync",
    "iteration", "batch_wait", "eval",
)  # fmt: skip


# An OTLP endpoint used only when its host name resolves: compose sets it to `otlp`, the
# trace viewer's name, which exists (and resolves) only when a viewer's profile is on.
OTLP_IF_RESOLVES = "MILLSTREAM_OTLP_ENDPOINT_IF_RESOLVES"


def _if_resolves(endpoint: str) -> str | None:
    host = urlsplit(endpoint).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return None
    return endpoint


def make_provider(service_name: str, run_dir: str | Path | None = None) -> TracerProvider | None:
    """A provider exporting as the environment says (see module docstring), or None.
    OpenTelemetry's own `OTEL_SDK_DISABLED=true` turns tracing off everywhere."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    replica = replica_name()
    resource = Resource.create({"service.name": service_name, "service.instance.id": replica})
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or _if_resolves(
        os.environ.get(OTLP_IF_RESOLVES, "")
    )
    exporters: list[SpanExporter] = []
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporters.append(PatientExporter(OTLPSpanExporter(endpoint=endpoint), endpoint))
    if run_dir is not None:
        path = Path(run_dir) / "traces" / f"{service_name}-{replica}.jsonl"
        exporters.append(JsonlSpanExporter(path))
    if not exporters:
        return None
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=500, max_queue_size=SPAN_QUEUE)
        )
    return provider


def mirror(tracer: trace.Tracer, span: Any, links: Sequence[trace.Link] | None = None) -> None:
    """A copy of the ended `span` (a train step, a weight sync, a batched request's router and
    engine spans: one span for many groups) in the trace of every group it links to (`links`,
    by default the span's own) but its own trace, as a child of the group's linked span, with
    the same name, times and stage and a link back. A trace viewer shows one trace at a time,
    so this is what puts them into each group's own trace; the copies carry MIRROR_OF and
    `millstream trace` skips them (it follows the links)."""
    links = getattr(span, "links", ()) if links is None else links
    ctx = span.get_span_context()
    start, end = getattr(span, "start_time", None), getattr(span, "end_time", None)
    if not ctx.is_valid or start is None or end is None:
        return  # the no-op tracer, or a span still open
    attributes = {MIRROR_OF: format(ctx.span_id, "016x")}
    stage = (getattr(span, "attributes", None) or {}).get(STAGE)
    if stage:
        attributes[STAGE] = stage
    for link in links:
        if link.context.trace_id == ctx.trace_id:
            continue  # its own trace has the span itself
        parent = trace.set_span_in_context(trace.NonRecordingSpan(link.context))
        copy = tracer.start_span(
            span.name, context=parent, start_time=start, links=[trace.Link(ctx)],
            attributes=attributes,
        )  # fmt: skip
        copy.end(end_time=end)


def replica_name() -> str:
    """This process among its service's replicas: host name and pid. The host name tells
    containers apart (in compose every replica is pid 1 of its own container, so the pid alone
    gave two rollout replicas one file); the pid tells apart the processes of one host (a
    local run's rollout workers). Characters outside [A-Za-z0-9_.-] become `_`."""
    host = re.sub(r"[^A-Za-z0-9_.-]+", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


# The SDK's default queue (2048 spans) drops spans in a burst: an eval round of a few thousand
# groups makes several spans each in every service at once, and every group must keep its
# trace. 32768 spans is a few tens of MB at worst. The export batch stays the SDK's 512: the
# exporter's thread holds the GIL while it encodes a batch, so larger ones stall the services.
SPAN_QUEUE = 32768


def setup_tracing(service_name: str, run_dir: str | Path | None = None) -> TracerProvider | None:
    """Install this process's tracer provider (once, from `main`). Returns it for shutdown."""
    provider = make_provider(service_name, run_dir)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return provider


def shutdown_tracing(provider: TracerProvider | None) -> None:
    """Flush and close the exporters; call from `main`'s finally. A collector that refuses
    gets the batches left for MILLSTREAM_OTLP_SHUTDOWN_S (`PatientExporter.closing`), not
    each its whole patience."""
    if provider is None:
        return
    for processor in provider._active_span_processor._span_processors:
        exporter = getattr(processor, "span_exporter", None)
        if isinstance(exporter, PatientExporter):
            exporter.closing()
    provider.shutdown()


# Paths that health checks, scrapers and the router's probes poll: a span each would bury
# the traces that matter (and cost every poll a span export).
PROBE_PATHS = frozenset({
    "/health", "/health_generate", "/liveness", "/readiness", "/metrics",
    "/get_weight_version", "/get_model_info", "/get_server_info", "/list_workers",
})  # fmt: skip


def fastapi_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry (`FastAPI(telemetry=...)`): one HTTP server span per
    request, continuing the caller's trace; no spans per dependency and endpoint call, no
    metrics or logs (ours are explicit), nothing for PROBE_PATHS. Its defaults made four
    spans of every request, health checks included."""
    return {
        "operation_spans": False,
        "metrics": False,
        "logs": False,
        "exclude": lambda scope: scope.get("path") in PROBE_PATHS,
    }


@functools.cache
def tracer(name: str) -> trace.Tracer:
    """One tracer per name and process (the SDK builds a new one per call: a cost on every
    group). Taken before setup_tracing, it is OpenTelemetry's proxy, which follows the
    provider set later."""
    return trace.get_tracer(name)


def messaging_attributes(stream: str, operation: str, **extra: Any) -> dict[str, Any]:
    """OpenTelemetry messaging attributes for a Redis stream produce/consume."""
    return {
        "messaging.system": "redis",
        "messaging.destination.name": stream,
        "messaging.operation.type": operation,
        **extra,
    }


def process_attributes(stream: str, entry_id: str, consumer_group: str) -> dict[str, Any]:
    """Messaging attributes of a consumer's `process {stream}` span for one entry."""
    return messaging_attributes(
        stream,
        "process",
        **{"messaging.consumer.group.name": consumer_group, "messaging.message.id": entry_id},
    )


def rpc_attributes(service: str, method: str) -> dict[str, str]:
    """OpenTelemetry RPC attributes of a call to `millstream.v1.{service}/{method}`."""
    return {"rpc.system": "grpc", "rpc.service": f"millstream.v1.{service}", "rpc.method": method}


def rpc_server_span(tr: trace.Tracer, service: str, method: str, metadata: Any, **kw: Any) -> Any:
    """A gRPC server span named and attributed as OpenTelemetry's RPC conventions say
    (`millstream.v1.Service/Method`), continuing the caller's trace from the metadata."""
    return tr.start_as_current_span(
        f"millstream.v1.{service}/{method}",
        context=context_from_grpc_metadata(metadata),
        kind=trace.SpanKind.SERVER,
        attributes={**rpc_attributes(service, method), **kw.pop("attributes", {})},
        **kw,
    )


def entry_time_ns(entry_id: str) -> int:
    """When Redis appended the entry: the ms part of its id, in ns since the epoch."""
    return int(entry_id.split("-", 1)[0]) * 1_000_000


def wait_span(
    tr: trace.Tracer,
    stream: str,
    stage: str,
    since_ns: int,
    parent: Any = None,
    attributes: Mapping[str, Any] | None = None,
    links: Sequence[trace.Link] = (),
) -> trace.Span:
    """A finished span for the time a group sat in `stream`: from `since_ns` to now.

    Clocks of two machines (Redis' and ours) can disagree: the start is never after now."""
    now = time.time_ns()
    span = tr.start_span(
        f"wait {stream}",
        context=parent,
        start_time=min(since_ns, now),
        links=links,
        attributes={STAGE: stage, **messaging_attributes(stream, "receive"), **(attributes or {})},
    )
    span.end(end_time=now)
    return span


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _carrier(items: Iterable[tuple[str | bytes, str | bytes]]) -> dict[str, str]:
    return {_text(k).lower(): _text(v) for k, v in items if _text(k).lower() in TRACE_FIELDS}


def inject_fields(fields: dict[str, Any] | None = None, context: Any = None) -> dict[str, Any]:
    """Add traceparent/tracestate of `context` (default: current) to a stream entry's fields."""
    fields = {} if fields is None else fields
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    for key in TRACE_FIELDS:
        fields[key] = carrier.get(key, "")
    return fields


def context_from_fields(fields: Mapping[Any, Any]) -> otel_context.Context:
    """The remote parent context carried by a stream entry's fields (str or bytes keys)."""
    return _PROPAGATOR.extract(_carrier((k, v) for k, v in fields.items() if v))


def inject_headers(headers: dict[str, str] | None = None, context: Any = None) -> dict[str, str]:
    """Add W3C trace headers of `context` (default: current) to outgoing HTTP headers."""
    headers = {} if headers is None else headers
    _PROPAGATOR.inject(headers, context=context)
    return headers


def context_from_headers(headers: Mapping[str, str]) -> otel_context.Context:
    """The remote parent context of an incoming HTTP request (header names any case)."""
    return _PROPAGATOR.extract(_carrier(headers.items()))


def current_group() -> tuple[str | None, SpanContext]:
    """The current span's group (its `millstream.group_id`: the rollout worker's `process`
    span has one) and context; the group is None outside a group's span or untraced."""
    span = trace.get_current_span()
    attributes = getattr(span, "attributes", None) or {}
    return attributes.get(GROUP_ID), span.get_span_context()


def groups_header(served: Iterable[tuple[str | None, SpanContext]]) -> str:
    """`X-Millstream-Groups`: `<group id>@<trace id>-<span id>` per traced group, comma-
    separated, the id percent-encoded; "" when none is traced."""
    return ",".join(
        f"{quote(gid, safe='')}@{ctx.trace_id:032x}-{ctx.span_id:016x}"
        for gid, ctx in served
        if gid and ctx.is_valid
    )


def group_request_headers(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """`headers` plus the current context's W3C headers and X-Millstream-Groups naming the
    current span's group: for a request made on a group's behalf (a plugin's /generate)."""
    out = inject_headers(dict(headers or {}))
    if groups := groups_header([current_group()]):
        out[GROUPS_HEADER] = groups
    return out


def served_groups(headers: Mapping[str, str]) -> tuple[dict[str, Any], list[trace.Link]]:
    """The attributes (`millstream.group_ids`) and links (one to each group's span) for the
    span of a request that names the groups it serves (`groups_header`); nothing when it names
    none. Malformed items are skipped: a trace is never worth refusing a request."""
    ids: list[str] = []
    links: list[trace.Link] = []
    for item in (headers.get(GROUPS_HEADER) or "").split(","):
        gid, _, ids_hex = item.strip().rpartition("@")
        trace_hex, _, span_hex = ids_hex.partition("-")
        try:
            ctx = SpanContext(
                int(trace_hex, 16), int(span_hex, 16), True, TraceFlags(TraceFlags.SAMPLED)
            )
        except ValueError:
            continue
        if gid and ctx.is_valid:
            ids.append(unquote(gid))
            links.append(trace.Link(ctx))
    return ({GROUP_IDS: ids} if ids else {}), links


def grpc_metadata(context: Any = None) -> list[tuple[str, str]]:
    """Outgoing gRPC metadata carrying the trace context (keys are lowercase, as gRPC wants)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return sorted(carrier.items())


def context_from_grpc_metadata(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> otel_context.Context:
    """The remote parent context of an incoming gRPC call (`context.invocation_metadata()`)."""
    return _PROPAGATOR.extract(_carrier(metadata or ()))
