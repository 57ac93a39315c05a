"""The router's Prometheus metrics, in a registry of its own per app (no global state).

Counters and the latency histogram are updated by the proxy as requests finish; per-worker
gauges (in flight, health, eligibility) are read from the Registry at scrape time, so a
removed worker disappears from /metrics instead of leaving a stale series behind.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .registry import HEALTHY, PENDING, UNHEALTHY, Registry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NO_WORKER = "none"

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)


class _WorkerGauges(Collector):
    def __init__(self, registry: Registry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "millstream_router_worker_in_flight", "requests in flight per worker", labels=["worker"]
        )
        health = GaugeMetricFamily(
            "millstream_router_worker_health",
            "1 for the worker's current health state (pending, healthy, unhealthy)",
            labels=["worker", "state"],
        )
        eligible = GaugeMetricFamily(
            "millstream_router_worker_eligible",
            "1 when the worker gets traffic (healthy and at the expected weight version)",
            labels=["worker"],
        )
        for w in self.registry.all():
            in_flight.add_metric([w.url], w.in_flight)
            for state in (PENDING, HEALTHY, UNHEALTHY):
                health.add_metric([w.url, state], 1.0 if w.status == state else 0.0)
            eligible.add_metric([w.url], 1.0 if self.registry.is_eligible(w) else 0.0)
        yield in_flight
        yield health
        yield eligible


class RouterMetrics:
    def __init__(self, registry: Registry):
        self.prom = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "millstream_router_requests",
            "proxied requests by the worker that answered and the status sent to the caller",
            ["worker", "status"],
            registry=self.prom,
        )
        self.latency = Histogram(
            "millstream_router_request_duration_seconds",
            "time from a proxied request's arrival to its last byte sent",
            buckets=LATENCY_BUCKETS,
            registry=self.prom,
        )
        self.retries = Counter(
            "millstream_router_retries",
            "retried attempts, by the worker whose attempt failed and why (connect, transport, http_5xx)",
            ["worker", "reason"],
            registry=self.prom,
        )
        self.prom.register(_WorkerGauges(registry))

    def render(self) -> bytes:
        return generate_latest(self.prom)
