"""Where spans go: JSONL files under a run dir, and an OTLP collector that may not listen yet
or may be busy (common/telemetry.py decides which, per process; its docstring says why).

`JsonlSpanExporter` appends one JSON object per span (`span_to_dict`) to one file per process;
`millstream trace` reads them. `PatientExporter` wraps the OTLP exporter: a batch the collector
refuses (not up yet, or Phoenix answering UNAVAILABLE "at capacity") is sent again with backoff
(common/retry.py) for up to MILLSTREAM_OTLP_PATIENCE_S, while the batch processor's queue holds
what comes meanwhile; at shutdown what is left gets MILLSTREAM_OTLP_SHUTDOWN_S in all.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

log = logging.getLogger(__name__)


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to one JSONL file, one object per span."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans]
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.writelines(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
        "events": [{"name": e.name, "ts_ns": e.timestamp} for e in span.events],
    }


OTLP_PATIENCE_S = 120.0
"""How long a batch the collector refuses is sent again (env MILLSTREAM_OTLP_PATIENCE_S)."""
OTLP_SHUTDOWN_S = 15.0
"""At shutdown, how long the batches left may still take in all (MILLSTREAM_OTLP_SHUTDOWN_S):
a worker drains for up to 10 s, compose gives it 30 s (stop_grace_period) before SIGKILL."""


class PatientExporter(SpanExporter):
    """`inner` (the OTLP exporter, whose own retries last its 10 s timeout), a refused batch
    sent again with backoff (common/retry.py) for up to `patience_s`; see module docstring.
    Blocking is the point: the batch processor's thread waits, its queue fills meanwhile.
    `dropped` counts the spans given up on. `closing()` (shutdown_tracing) bounds what is left:
    every batch, the one under way included, is tried until `shutdown_s` from then, no longer,
    so a process whose collector is gone still exits."""

    def __init__(
        self,
        inner: SpanExporter,
        endpoint: str,
        patience_s: float | None = None,
        shutdown_s: float | None = None,
    ):
        self.inner = inner
        self.endpoint = endpoint
        env = os.environ.get
        self.patience_s = patience_s or float(env("MILLSTREAM_OTLP_PATIENCE_S", OTLP_PATIENCE_S))
        self.shutdown_s = shutdown_s or float(env("MILLSTREAM_OTLP_SHUTDOWN_S", OTLP_SHUTDOWN_S))
        self.dropped = 0
        self._closing = threading.Event()
        self._deadline = float("inf")  # set by closing()
        self._down_since: float | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from tenacity import Retrying, retry_if_result

        from .retry import Backoff

        if time.monotonic() >= self._deadline:
            return self._drop(spans)  # shutting down, out of time: no more tries
        backoff = Backoff(within_s=self.patience_s, first_s=0.5, max_s=5.0)
        tries = Retrying(
            stop=backoff.stop() | (lambda state: time.monotonic() >= self._deadline),
            wait=lambda state: backoff.delay(state.attempt_number),
            retry=retry_if_result(lambda result: result is not SpanExportResult.SUCCESS),
            sleep=self._sleep,
            retry_error_callback=lambda state: state.outcome.result(),
            before_sleep=lambda state: self._refused(),
        )
        result = tries(self.inner.export, spans)
        if result is SpanExportResult.SUCCESS:
            if self._down_since is not None:
                log.warning(
                    "spans to %s: taken again after %.1f s",
                    self.endpoint, time.monotonic() - self._down_since,
                )  # fmt: skip
                self._down_since = None
            return result
        return self._drop(spans)

    def _sleep(self, seconds: float) -> None:
        """The backoff's wait; closing() ends it early (the next try at once), and a wait
        while closing ends at the deadline."""
        if not self._closing.is_set():
            self._closing.wait(seconds)
        else:
            time.sleep(max(0.0, min(seconds, self._deadline - time.monotonic())))

    def _drop(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._down_since is None:
            self._down_since = time.monotonic()
        self.dropped += len(spans)
        log.warning(
            "spans to %s: %d dropped, the collector refusing them since %.0f s (%d in all)",
            self.endpoint, len(spans), time.monotonic() - self._down_since, self.dropped,
        )  # fmt: skip
        return SpanExportResult.FAILURE

    def _refused(self) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "spans to %s: the collector does not take them (not up yet, or busy); "
                "sending again for up to %.0f s while new spans wait in the queue",
                self.endpoint, self.patience_s,
            )  # fmt: skip

    def closing(self) -> None:
        if not self._closing.is_set():
            self._deadline = time.monotonic() + self.shutdown_s
            self._closing.set()

    def shutdown(self) -> None:
        self.closing()
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)
