"""tests/support's own mechanisms. free_port: each xdist worker takes ports from a span of its
own below the kernel's ephemeral range, so neither the other worker nor a service binding port 0
is handed a port between free_port() and the bind of the service it was for. start_engines:
engines started at once, none left running when one fails."""

from __future__ import annotations

import itertools
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import engine_proc, redis_server
from tests.support.redis_server import _port_span, free_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_each_worker_has_its_own_span_below_the_ephemeral_ports(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    spans = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        spans.append(_port_span())
    a, b = spans
    assert len(a) >= 1000 and len(b) >= 1000
    assert not set(a) & set(b)
    assert max(b) < _ephemeral_low() and min(a) >= 1024
    # Without xdist (the contract and live tiers, benches): the whole span.
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    whole = _port_span()
    assert set(a) | set(b) <= set(whole)


def test_ports_come_from_the_span_each_once_and_never_one_in_use(
    monkeypatch: pytest.MonkeyPatch,
):
    with ThreadPoolExecutor(8) as pool:
        ports = list(pool.map(lambda _: free_port(), range(64)))
    assert len(set(ports)) == len(ports)
    assert all(p in redis_server._SPAN for p in ports)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))  # a span of one port, which somebody listens on
        listener.listen()
        taken = listener.getsockname()[1]
        monkeypatch.setattr(redis_server, "_SPAN", range(taken, taken + 1))
        with pytest.raises(RuntimeError, match="no free loopback port"):
            free_port()
    assert free_port() == taken  # free again


def test_start_engines_stops_the_ones_that_started_when_one_fails(monkeypatch, tmp_path):
    """Engines started at once: one that fails to start does not leave the others running."""
    started: list[_Engine] = []
    order = itertools.count()  # next() is atomic: which start is the second, whatever the race

    class _Engine:
        def __init__(self, model_dir: Path, log_dir: Path, *extra: str):
            if next(order) == 1:  # the second to start fails, as on a port taken meanwhile
                raise RuntimeError("engine exited with 3 during startup")
            self.stopped = False
            started.append(self)

        def stop(self) -> None:
            self.stopped = True

    monkeypatch.setattr(engine_proc, "EngineProcess", _Engine)
    with pytest.raises(RuntimeError, match="during startup"):
        engine_proc.start_engines(tmp_path, tmp_path, 2)
    assert started[0].stopped
