"""Where engines reach the trainer (build.master_address): the Coordinator and the weight-sync
rendezvous at one address, and a multi-host run whose host name resolves to loopback said at
start (Debian's /etc/hosts maps a host's name to 127.0.1.1)."""

from __future__ import annotations

import asyncio

from millstream.common.config import parse_run_config
from millstream.trainer import build
from millstream.trainer.weights.coordinator import Coordinator


def _cfg(*flags: str):
    return parse_run_config(["--rollout-batch-size", "2", *flags], mode="sync")


def test_one_machine_is_loopback_and_says_nothing():
    cfg = _cfg("--router-url", "http://127.0.0.1:30000")
    assert build.master_address(cfg) == "127.0.0.1"
    assert build.loopback_warning(cfg, "127.0.0.1") is None


def test_the_flag_wins_and_the_coordinator_advertises_it():
    cfg = _cfg("--router-url", "http://router:30000", "--weight-sync-master-address", "10.0.0.7")
    assert build.master_address(cfg) == "10.0.0.7"
    coordinator = Coordinator("run")
    assert asyncio.run(coordinator.advertise(None, 50051, build.master_address(cfg))) == (
        "10.0.0.7:50051"
    )


def test_a_remote_router_with_a_loopback_host_name_is_said(monkeypatch):
    monkeypatch.setattr(build, "host_address", lambda: "127.0.1.1")
    cfg = _cfg("--router-url", "http://router:30000")
    here = build.master_address(cfg)
    assert here == "127.0.1.1"
    warning = build.loopback_warning(cfg, here)
    assert warning is not None and "--weight-sync-master-address" in warning
    assert "router" in warning
    monkeypatch.setattr(build, "host_address", lambda: "10.0.0.7")
    assert build.loopback_warning(_cfg("--router-url", "http://router:30000"), "10.0.0.7") is None
