"""Router registry: health state transitions, version gating, in-flight pairing, config."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from millstream.common.config.errors import ConfigError
from millstream.router.config import RouterConfig, normalize_worker_url, parse_router_config
from millstream.router.registry import HEALTHY, PENDING, UNHEALTHY, Registry


def test_new_worker_is_pending_until_its_first_passed_check():
    reg = Registry(failure_threshold=2, success_threshold=3)
    w, created = reg.add("http://a:1")
    assert created and w.status == PENDING and reg.eligible() == []
    assert reg.add("http://a:1") == (w, False)
    reg.record_success(w)
    assert w.status == HEALTHY and reg.eligible() == [w]


def test_failures_take_a_worker_out_and_successes_bring_it_back():
    reg = Registry(failure_threshold=2, success_threshold=2)
    w, _ = reg.add("http://a:1")
    reg.record_success(w)
    reg.record_failure(w, "refused")
    assert w.status == HEALTHY  # one failure is below the threshold
    reg.record_success(w)
    reg.record_failure(w, "refused")
    assert w.status == HEALTHY  # the success reset the count
    reg.record_failure(w, "refused")
    assert w.status == UNHEALTHY and reg.eligible() == []
    assert "refused" in reg.why_none()
    reg.record_success(w)
    assert w.status == UNHEALTHY  # needs two in a row
    reg.record_failure(w, "again")
    reg.record_success(w)
    assert w.status == UNHEALTHY
    reg.record_success(w)
    assert w.status == HEALTHY and reg.eligible() == [w]


def test_version_gating():
    reg = Registry()
    a, _ = reg.add("http://a:1")
    b, _ = reg.add("http://b:1")
    reg.record_success(a, weight_version="1")
    reg.record_success(b, weight_version="2")
    assert reg.eligible() == [a, b]  # no expected version: any version serves
    reg.set_expected_version("2")
    assert reg.eligible() == [b]
    reg.set_expected_version("3")
    assert reg.eligible() == []
    assert "weight version '3'" in reg.why_none()
    reg.record_success(a, weight_version="3")
    assert reg.eligible() == [a]
    reg.record_version_unknown(a, "/get_weight_version failed")
    assert reg.eligible() == []
    reg.set_expected_version(None)
    assert reg.eligible() == [a, b]


def test_a_probe_sent_before_a_vouch_does_not_undo_it():
    reg = Registry()
    w, _ = reg.add("http://a:1")
    reg.record_success(w, weight_version="1")
    reg.set_expected_version("2")
    assert reg.version_pending() and reg.eligible() == []
    probed_at = time.monotonic()  # a health probe goes out and reads the old version...
    reg.vouch(w, "2")  # ...while the weight sync confirms the new one
    reg.record_version(w, "1", probed_at)
    assert w.weight_version == "2" and reg.eligible() == [w] and not reg.version_pending()
    reg.record_version(w, "3", time.monotonic())  # a later probe is believed
    assert w.weight_version == "3" and reg.eligible() == []


def test_waiters_wake_on_a_change_and_time_out_without_one():
    async def scenario() -> tuple[float, float]:
        reg = Registry()
        w, _ = reg.add("http://a:1")
        reg.record_success(w, weight_version="1")
        reg.set_expected_version("2")
        start = time.monotonic()
        await reg.wait_for_change(0.2)
        timed_out = time.monotonic() - start
        asyncio.get_running_loop().call_later(0.05, reg.vouch, w, "2")
        start = time.monotonic()
        await reg.wait_for_change(5.0)
        return timed_out, time.monotonic() - start

    timed_out, woken = asyncio.run(scenario())
    assert 0.2 <= timed_out < 1.0
    assert woken < 1.0


def test_in_flight_pairs_and_removed_workers_are_not_eligible():
    reg = Registry()
    w, _ = reg.add("http://a:1")
    reg.record_success(w)
    reg.begin(w)
    reg.begin(w)
    assert w.in_flight == 2 and w.served == 2
    assert reg.remove("http://a:1") is w
    assert not reg.is_eligible(w)
    reg.end(w)
    reg.end(w)
    assert w.in_flight == 0
    with pytest.raises(AssertionError, match="negative"):
        reg.end(w)
    assert "no worker registered" in reg.why_none()


def test_by_id_and_order():
    reg = Registry()
    urls = [f"http://w{i}:1" for i in range(3)]
    ws = [reg.add(u)[0] for u in urls]
    assert [w.url for w in reg.all()] == urls
    assert reg.by_id(ws[1].id) is ws[1] and reg.by_id("nope") is None


def test_worker_urls_are_normalized_and_validated():
    assert normalize_worker_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    for bad in ("127.0.0.1:8000", "ftp://x:1", "http://x:1/generate", "http://x:port"):
        with pytest.raises(ValueError, match="worker url"):
            normalize_worker_url(bad)
    cfg = RouterConfig(worker_urls=["http://a:1/", "http://a:1"])
    assert cfg.worker_urls == ["http://a:1"]
    with pytest.raises(ConfigError, match="--worker-urls"):
        RouterConfig(worker_urls=["a:1"])


def test_config_flags_and_env_token():
    cfg = parse_router_config(
        [
            "--port",
            "1234",
            "--router-policy",
            "cache_aware",
            "--worker-urls",
            "http://a:1",
            "http://b:2",
        ],
        environ={"MILLSTREAM_ADMIN_TOKEN": "s3cret"},
    )
    assert cfg.port == 1234 and cfg.router_policy == "cache_aware"
    assert cfg.worker_urls == ["http://a:1", "http://b:2"]
    assert cfg.admin_token == "s3cret"
    flag_wins = parse_router_config(["--admin-token", "x"], environ={"MILLSTREAM_ADMIN_TOKEN": "y"})
    assert flag_wins.admin_token == "x"
    assert parse_router_config([], environ={}).admin_token is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-retries", "-1"], "--max-retries"),
        (["--health-check-interval", "0"], "--health-check-interval"),
        (["--cache-threshold", "1.5"], "--cache-threshold"),
        (["--balance-rel-threshold", "0.5"], "--balance-rel-threshold"),
        (["--router-policy", "random"], "--router-policy"),
        (["--max-request-bytes", "0"], "--max-request-bytes"),
        (["--max-retr", "1"], "unrecognized arguments"),  # no abbreviations
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_router_config(argv, environ={})
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_router_does_not_import_torch():
    code = "import millstream.router.main, sys; assert 'torch' not in sys.modules, 'torch'; assert 'transformers' not in sys.modules, 'transformers'"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_the_eligible_list_is_kept_until_what_decides_eligibility_changes():
    reg = Registry()
    a, _ = reg.add("http://a:1")
    b, _ = reg.add("http://b:1")
    reg.record_success(a, weight_version="1")
    kept = reg.eligible()
    assert kept == [a] and reg.eligible() is kept
    woken = reg._change
    reg.record_success(a, weight_version="1")  # a check that changes nothing: the steady state
    assert reg.eligible() is kept and not woken.is_set()
    reg.record_success(b, weight_version="1")  # pending -> healthy
    assert woken.is_set() and reg.eligible() == [a, b]
    reg.set_expected_version("2")
    assert reg.eligible() == []
    reg.vouch(b, "2")
    assert reg.eligible() == [b]
    for _ in range(3):
        reg.record_failure(b, "refused")
    assert reg.eligible() == []
    reg.remove("http://b:1")
    reg.vouch(a, "2")
    assert reg.eligible() == [a]


async def _spread_round(answer, timeout: float) -> tuple[float, Registry]:
    """One spread health round over 4 * SPREAD_BATCH + 1 healthy workers, each answered by
    `answer` (an httpx MockTransport handler), interval 0.5 s: how long it took, the workers."""
    import httpx

    from millstream.router.health import SPREAD_BATCH, HealthChecker

    reg = Registry()
    for i in range(4 * SPREAD_BATCH + 1):
        w, _ = reg.add(f"http://w{i}:1")
        reg.record_success(w)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        checker = HealthChecker(reg, client, interval=0.5, timeout=timeout)
        start = time.monotonic()
        await checker.spread_round()
        return time.monotonic() - start, reg


def test_a_large_fleet_is_checked_in_batches_spread_over_the_interval():
    """Every worker once a round, SPREAD_BATCH at a time, not all in the same instant (a
    round of hundreds at once held the router's loop for tens of ms: bench/bench_fleet.py)."""
    import httpx

    from millstream.router.health import SPREAD_BATCH

    checked: dict[str, float] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        checked[f"{request.url.host}"] = time.monotonic()
        return httpx.Response(200)

    took, _ = asyncio.run(_spread_round(answer, timeout=1.0))
    assert len(checked) == 4 * SPREAD_BATCH + 1  # each worker once
    times = sorted(checked.values())
    assert times[-1] - times[0] >= 0.3  # five batches, 0.1 s apart
    assert max(sum(1 for t in times if abs(t - u) < 0.01) for u in times) <= SPREAD_BATCH
    assert took < 1.5


def test_silent_workers_do_not_push_the_next_batches_back():
    """A batch whose workers do not answer (a partition: each check waits out its timeout)
    leaves the later batches at their slots: the round takes `interval` plus one batch's
    timeout at most, not a timeout per silent batch on top of the interval."""
    import httpx

    from millstream.router.health import SPREAD_BATCH

    checked: dict[str, float] = {}
    silent = {f"w{i}" for i in range(2 * SPREAD_BATCH)}  # the first two batches
    t0 = time.monotonic()

    async def answer(request: httpx.Request) -> httpx.Response:
        checked[request.url.host] = time.monotonic() - t0
        if request.url.host in silent:
            await asyncio.sleep(0.4)  # the client's timeout, as a silent peer costs it
            raise httpx.ReadTimeout("silent", request=request)
        return httpx.Response(200)

    took, reg = asyncio.run(_spread_round(answer, timeout=0.4))
    assert len(checked) == 4 * SPREAD_BATCH + 1
    last = max(checked.values())  # the fifth batch's slot: 0.5 s (two silent batches before)
    assert last < 0.7, sorted(checked.values())
    assert took < 0.5 + 0.4 + 0.3, took
    assert all(w.consecutive_failures == 1 for w in reg.all() if httpx.URL(w.url).host in silent)
