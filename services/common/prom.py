"""Prometheus metrics shared by every service: registries, the scrape server of the processes
that have no HTTP server of their own, and the collectors of what they all have in common.

Names (held by tests/unit/trainer/observe/test_prom.py for every service): `millstream_<service>_...`
or, for what every service shares, `millstream_worker_...` and `millstream_stream_...`; units
in the name (`_seconds`, `_tokens`, `_entries`), `_total` on counters, base units only.

* One `CollectorRegistry` per process or app (`new_registry`), never the global one: tests
  build many in one process, and a scrape shows only millstream's series.
* `serve_metrics(registry, port)`: prometheus_client's HTTP server in a daemon thread, for
  the rollout and reward workers and the trainer (`--metrics-port`); port 0 binds a free port
  (`MetricsServer.port` says which, and the services print it). The router and the engines
  answer `GET /metrics` on their own HTTP port instead.
* Values that already live in an object (a StreamWorker's counts, a stream's length) are read
  at scrape time by a collector: nothing is counted twice, and the hot paths do not change.

Queue depths, per stream and consumer group (`StreamDepths`): `millstream_stream_entries`
(XLEN: what the stream holds, acked entries included until the trainer trims them),
`millstream_stream_lag_entries` (not yet delivered to the group: the queue) and
`millstream_stream_pending_entries` (delivered, not yet acked: in the works). Every process
that exports them asks Redis at each scrape with a client of its own, so aggregate over
processes with max(), not sum().
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .errors import MillstreamError

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_REDIS_TIMEOUT_S = 2.0

DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""Seconds of one group's rollout or reward, or of one weight sync: tens of ms to minutes."""


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def render(registry: CollectorRegistry) -> bytes:
    """The text exposition format of `registry` (the body of GET /metrics)."""
    return generate_latest(registry)


def split_key(key: str) -> tuple[str, str]:
    """("run", "prompts") from "run:prompts" (run ids hold no ':', keys.py)."""
    run, _, name = key.rpartition(":")
    return run, name


class MetricsServer:
    """A running scrape endpoint; `close()` stops it (idempotent)."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0"):
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._httpd.server_port
        self._closed = threading.Event()
        self.on_close: list[Callable[[], None]] = []

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            for close in self.on_close:
                close()

    async def aclose(self) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serve `registry` at http://host:port/metrics (any path answers) from a daemon thread."""
    return MetricsServer(registry, port, host)


def start_metrics(
    service: str,
    registry: CollectorRegistry,
    port: int,
    *,
    redis_url: str | None = None,
    redis_password: str | None = None,
    streams: Iterable[str] = (),
) -> MetricsServer:
    """A service's `--metrics-port`: add the depths of `streams` (full keys, read with a client
    of its own on `redis_url`), serve `registry` on all interfaces, print the port (port 0
    picks a free one). `close()` stops the server and closes that client."""
    streams = list(streams)
    depths = None
    if streams:
        assert redis_url is not None
        url = redis_url
        depths = StreamDepths(lambda: sync_redis(url, redis_password), streams)
        registry.register(depths)
    try:
        server = serve_metrics(registry, port)
    except OSError as err:
        if depths is not None:
            depths.close()
        reason = err.strerror or str(err)
        raise MillstreamError(f"--metrics-port {port}: cannot listen there ({reason})") from None
    if depths is not None:
        server.on_close.append(depths.close)
    print(f"[{service}] Prometheus /metrics on port {server.port}", flush=True)
    return server


class _Collector:
    """A collector that describes itself without collecting: `auto_describe` would collect
    at registration, and some collectors ask Redis."""

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> list[Metric]:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


Reading = Callable[[], float | dict[tuple[str, ...], float]]


class Readings(_Collector):
    """Counters and gauges whose values live in other objects, read at each scrape:
    `add("counter", name, doc, read)`, where `read()` returns the value, or, with
    `labels`, a dict from label values to value. A counter's name is given without
    `_total` (prometheus_client adds it)."""

    def __init__(self) -> None:
        self._specs: list[tuple[str, str, str, Reading, tuple[str, ...]]] = []

    def add(
        self, kind: str, name: str, doc: str, read: Reading, labels: tuple[str, ...] = ()
    ) -> None:
        if kind not in ("counter", "gauge"):
            raise ValueError(f"kind must be counter or gauge (got {kind!r})")
        self._specs.append((kind, name, doc, read, labels))

    def _families(self) -> list[Metric]:
        cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        return [cls[kind](name, doc, labels=labels) for kind, name, doc, _, labels in self._specs]

    def collect(self) -> Iterator[Metric]:
        for family, (_, _, _, read, labels) in zip(self._families(), self._specs, strict=True):
            value = read()
            if labels:
                assert isinstance(value, dict)
                for label_values, v in value.items():
                    family.add_metric(list(label_values), v)
            else:
                assert not isinstance(value, dict)
                family.add_metric([], value)
            yield family


class WorkerLike(Protocol):
    """What `WorkerCounts` reads from a `millstream.common.worker.StreamWorker`."""

    name: str
    processed: int
    failed: int
    consumer: Any

    @property
    def dead_lettered(self) -> int: ...

    @property
    def in_flight(self) -> int: ...


class WorkerCounts(_Collector):
    """Per-StreamWorker job counts, labelled by worker name, stream and consumer group.

    processed: handlers that returned; failed: handlers that raised (the entry is delivered
    again, and dead-lettered after --max-deliveries); dead-lettered: entries this worker sent
    to {run}:dead (poison at once, or over-delivered)."""

    LABELS = ("worker", "stream", "group")

    def __init__(self, workers: Iterable[WorkerLike]):
        self.workers: list[WorkerLike] = list(workers)

    def _families(self) -> list[Metric]:
        return [
            CounterMetricFamily(
                "millstream_worker_jobs_processed",
                "stream entries whose job returned (handed off or acked)",
                labels=self.LABELS,
            ),
            CounterMetricFamily(
                "millstream_worker_jobs_failed",
                "jobs whose handler raised; the entry stays pending for redelivery",
                labels=self.LABELS,
            ),
            CounterMetricFamily(
                "millstream_worker_entries_dead_lettered",
                "entries this worker dead-lettered: poison ones and over-delivered ones",
                labels=self.LABELS,
            ),
            GaugeMetricFamily(
                "millstream_worker_jobs_in_flight", "jobs running now", labels=self.LABELS
            ),
        ]

    def collect(self) -> Iterator[Metric]:
        processed, failed, dead, in_flight = families = self._families()
        for w in self.workers:
            _run, stream = split_key(w.consumer.stream)
            labels = [w.name, stream, w.consumer.group]
            processed.add_metric(labels, w.processed)
            failed.add_metric(labels, w.failed)
            dead.add_metric(labels, w.dead_lettered)
            in_flight.add_metric(labels, w.in_flight)
        yield from families


def sync_redis(url: str, password: str | None) -> Any:
    """A synchronous client for scrapes (they run in the scrape server's thread, outside any
    event loop); short timeouts, so a scrape never hangs on a gone Redis."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from .redis_conn import password_for

    return redis.Redis.from_url(
        url,
        password=password_for(url, password),
        socket_timeout=SCRAPE_REDIS_TIMEOUT_S,
        socket_connect_timeout=SCRAPE_REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), 0),  # the next scrape is the retry
    )


class StreamDepths(_Collector):
    """Length, lag and pending count of `streams` (full keys) and their consumer groups, read
    from Redis at each scrape (see the module docstring). `connect` makes the synchronous
    client on the first scrape (`sync_redis`); `close()` closes it."""

    def __init__(self, connect: Callable[[], Any], streams: Iterable[str]):
        self._connect = connect
        self._client: Any = None
        self.streams = list(streams)
        self._lock = threading.Lock()

    def _redis(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def _families(self) -> list[Metric]:
        return [
            GaugeMetricFamily(
                "millstream_stream_entries",
                "entries in the stream (XLEN): acked ones too, until the trainer trims them",
                labels=["run", "stream"],
            ),
            GaugeMetricFamily(
                "millstream_stream_lag_entries",
                "entries not yet delivered to the consumer group: the queue in front of it",
                labels=["run", "stream", "group"],
            ),
            GaugeMetricFamily(
                "millstream_stream_pending_entries",
                "entries delivered to the consumer group and not yet acked: in the works",
                labels=["run", "stream", "group"],
            ),
        ]

    def collect(self) -> Iterator[Metric]:
        entries, lag, pending = families = self._families()
        try:
            pipe = self._redis().pipeline(transaction=False)
            for key in self.streams:
                pipe.xlen(key)
                pipe.xinfo_groups(key)
            replies = pipe.execute(raise_on_error=False)
        except Exception as err:  # a scrape reports what it can; Redis may be restarting
            log.warning("metrics: cannot read stream depths from Redis: %s", err)
            yield from families  # no samples: the rest of the scrape still answers
            return
        for i, key in enumerate(self.streams):
            run, stream = split_key(key)
            length, groups = replies[2 * i], replies[2 * i + 1]
            if isinstance(length, int):
                entries.add_metric([run, stream], length)
            if isinstance(groups, Exception):  # no such stream yet: no groups
                continue
            for group in groups:
                name = _text(group["name"])
                pending.add_metric([run, stream, name], group["pending"])
                if group.get("lag") is not None:  # unknown after some deletions (Redis 7)
                    lag.add_metric([run, stream, name], group["lag"])
        yield from families


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
