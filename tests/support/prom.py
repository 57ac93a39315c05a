"""Scrape a service's Prometheus /metrics over HTTP and read samples by name and labels."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Samples:
    def __init__(self, text: str):
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def value(self, name: str, **labels: str) -> float:
        """The one sample called `name` whose labels include `labels`."""
        found = [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples match"
        return found[0]


def scrape(url: str) -> Samples:
    resp = httpx.get(url, timeout=5.0)
    assert resp.status_code == 200, f"{url} -> {resp.status_code}"
    return Samples(resp.text)


def scrape_until(url: str, done: Callable[[Samples], bool], timeout_s: float = 10.0) -> Samples:
    """Scrape until `done(samples)`: counters of a job move just after its output shows."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if done(samples):
            return samples
        assert time.monotonic() < deadline, f"{url}: condition not reached in {timeout_s} s"
        time.sleep(0.05)


def metrics_url(log: str, service: str) -> str:
    """The URL of the metrics port a service printed at start (`--metrics-port 0`)."""
    found = re.search(rf"\[{service}\] Prometheus /metrics on port (\d+)", log)
    assert found, f"no metrics port line in the {service} log:\n{log[-2000:]}"
    return f"http://127.0.0.1:{found.group(1)}/metrics"
