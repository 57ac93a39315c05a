"""The partition harness itself (tests/chaos/net/netns.py), in seconds: a cut link is silent
(a connect waits for its own timeout, past the 3 s after which a failed ARP would answer
EHOSTUNREACH; an open connection's bytes wait), other links stay up, the heal delivers what
waited, and nothing is left behind. Root only: skipped elsewhere, saying why. The scenarios
that use it run in `make chaos-net`, never here.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from .netns import Network, clean_stale, namespaces, unavailable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def _namespaces_possible() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)


def _connect(address: str, timeout_s: float) -> tuple[str, float]:
    """What a connect to `address`:7000 met, and after how long."""
    start = time.monotonic()
    try:
        socket.create_connection((address, 7000), timeout=timeout_s).close()
        outcome = "connected"
    except TimeoutError:
        outcome = "timed out"
    except OSError as err:  # ECONNREFUSED, EHOSTUNREACH, ENETUNREACH: not silence
        outcome = f"{type(err).__name__}: {err}"
    return outcome, time.monotonic() - start


def test_a_cut_link_is_silent_both_ways_and_the_heal_delivers_what_waited():
    net = Network(["a", "b", "c"])
    try:
        server = net.call_in("b", socket.create_server, (net.address("b"), 7000))
        client = net.call_in("a", socket.create_connection, (net.address("b"), 7000), 2)
        accepted, _ = server.accept()
        partition = net.partition("a", 60, peers=["b"])
        client.sendall(b"ping")
        outcome, took = net.call_in("a", _connect, net.address("b"), 4.0)
        assert (outcome, took >= 3.9) == ("timed out", True), (outcome, took)
        assert net.call_in("c", _connect, net.address("b"), 2.0)[0] == "connected"
        accepted.setblocking(False)
        with pytest.raises(BlockingIOError):
            accepted.recv(16)  # the ping waits behind the cut
        partition.heal()
        accepted.settimeout(10)
        assert accepted.recv(16) == b"ping"  # retransmitted once the link is back
        assert net.call_in("a", _connect, net.address("b"), 2.0)[0] == "connected"
        for s in (client, accepted, server):
            s.close()
    finally:
        net.close()


def test_close_kills_what_runs_inside_and_leaves_no_namespace():
    net = Network(["a"])
    proc = subprocess.Popen(net.argv("a", ["sleep", "60"]))
    time.sleep(0.2)
    net.close()
    assert proc.wait(timeout=5) != 0
    assert not [ns for ns in namespaces() if ns.startswith(net.prefix + "-")]


def test_namespaces_of_a_dead_harness_are_deleted():
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    stale = f"ms{gone.pid}-left"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in clean_stale()
        assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
    assert f"ms{os.getpid()}-" not in " ".join(namespaces())
