"""Engines come back: a router SIGKILLed and started again on its port, and the only engine
SIGKILLed and replaced, against real processes (router, engines on the tiny model); this
process is the trainer's side (WeightSync and its EngineKeeper, rank 0 of the update group).

  * the router away for ~2 s mid-run: the sync waits for it, says so twice, and the restarted
    router gets its engines back, gated on the current version, and serves the new one;
  * a restarted router that lists an engine from its own flags (--worker-urls) holding old
    weights: the keeper gates it on the current version at its next look, so no request goes
    to the stale engine, and adds back the engines that served;
  * the only engine SIGKILLed: the sync waits (admission paused, one line) for a new engine,
    registered with the router 2 s later, syncs it first and goes on; with no engine for the
    whole --stall-timeout, the old error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from millstream.trainer.weights.keeper import EngineKeeper
from millstream.trainer.weights.sync import NoEngineLeft, WeightSync
from tests.integration.test_weight_sync import hf_model, served_version, versions
from tests.support.engine_proc import EngineProcess, start_engines
from tests.support.redis_server import free_port
from tests.support.router_proc import ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

TOKEN = "come-back"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENGINE_FLAGS = ("--weight-version", "v0", "--weight-update-timeout", "10", "--admin-token", TOKEN)


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProcess]]:
    procs = start_engines(tiny_model_dir, tmp_path_factory.mktemp("engines"), 2, *ENGINE_FLAGS)
    yield procs
    for proc in procs:
        proc.stop()


@pytest.fixture
def routers(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    """start(port, *flags): a router with the token on `port`, ready."""
    started: list[ServiceProcess] = []

    def start(port: int, *flags: str) -> ServiceProcess:
        args = ["--admin-token", TOKEN, "--health-check-timeout", "1", *flags]
        router = ServiceProcess("router", args, tmp_path, port=port).wait_ready("/liveness", 30)
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


@pytest.fixture
def run() -> Iterator[Callable[[Awaitable[Any]], Any]]:
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


def router_state(url: str) -> tuple[list[str], str | None, list[str]]:
    """(listed, the version it serves, the engines it routes to)."""
    workers = httpx.get(f"{url}/workers").json()["workers"]
    version = httpx.get(f"{url}/get_weight_version").json()["weight_version"]
    return (
        sorted(w["url"] for w in workers),
        version,
        sorted(w["url"] for w in workers if w["eligible"]),
    )


def test_a_router_restarted_mid_run_waits_and_gets_its_engines_and_version_back(
    engines: list[EngineProcess], routers, tiny_model_dir: Path, run, capsys
):
    urls = sorted(e.url for e in engines)
    port = free_port()
    router = routers(port)
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, stall_timeout_s=60)
    try:
        run(ws.sync(hf_model(tiny_model_dir, seed=1).named_parameters(), 1, join=urls))
        assert router_state(router.url) == (urls, "1", urls)
        capsys.readouterr()

        router.kill()
        with ThreadPoolExecutor(1) as pool:
            again = pool.submit(lambda: (time.sleep(2), routers(port))[1])
            try:
                model = hf_model(tiny_model_dir, seed=2)
                start = time.monotonic()
                report = run(ws.sync(model.named_parameters(), 2))
                took = time.monotonic() - start
            finally:
                router = again.result()  # the fixture stops it
        assert report.engines == urls and report.removed == {}
        assert versions(*urls) == ["2", "2"]
        assert router_state(router.url) == (urls, "2", urls)
        assert served_version(router.url) == "2"
        out = capsys.readouterr().out
        print(f"router away: the sync waited and finished in {took:.1f} s")
        assert 2 < took < 40, out
        assert out.count("waiting up to 60 s (--stall-timeout) for the router at") == 1, out
        assert out.count(f"the router at {router.url} answers again (away ") == 1, out
        assert "restarted and forgot its engines: gated it on weight version 1, added back 2" in out
    finally:
        run(ws.close())


def test_a_restarted_router_gates_a_stale_engine_from_its_flags_on_the_current_version(
    engines: list[EngineProcess], routers, tiny_model_dir: Path, run, capsys
):
    serving, stale = engines[0].url, engines[1].url
    port = free_port()
    router = routers(port)
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, stall_timeout_s=60)
    keeper = EngineKeeper(ws, stall_timeout_s=60, poll_s=0.2)
    try:
        model = hf_model(tiny_model_dir, seed=3)
        run(ws.sync(model.named_parameters(), 11, join=[serving]))
        (old,) = versions(stale)
        assert old != "11" and versions(serving) == ["11"]

        router.kill()
        router = routers(port, "--worker-urls", stale)
        # Before the trainer looks: no version to gate on, so the stale engine serves.
        assert router_state(router.url) == ([stale], None, [stale])
        capsys.readouterr()
        assert run(keeper.check(model.named_parameters(), 11)) is None  # no sync needed
        assert router_state(router.url) == (sorted([serving, stale]), "11", [serving])
        assert {served_version(router.url) for _ in range(6)} == {"11"}
        out = capsys.readouterr().out
        assert "gated it on weight version 11, added back 1 engine(s)" in out, out

        report = run(ws.sync(hf_model(tiny_model_dir, seed=4).named_parameters(), 12))
        assert report.engines == sorted([serving, stale]) and versions(serving, stale) == ["12"] * 2
        assert router_state(router.url)[1:] == ("12", sorted([serving, stale]))
    finally:
        run(ws.close())


def test_the_only_engine_killed_the_sync_waits_for_a_new_one_and_syncs_it_first(
    routers, tiny_model_dir: Path, tmp_path: Path, run, capsys
):
    router = routers(free_port())
    first = EngineProcess(tiny_model_dir, tmp_path, *ENGINE_FLAGS)
    second = None
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=5, stall_timeout_s=60)
    keeper = EngineKeeper(ws, stall_timeout_s=60, poll_s=0.2)
    try:
        run(keeper.sync(hf_model(tiny_model_dir, seed=5).named_parameters(), 1, join=[first.url]))
        first.proc.kill()
        first.proc.wait()
        capsys.readouterr()

        def replace() -> EngineProcess:
            time.sleep(2)
            flags = (*ENGINE_FLAGS, "--register-with", router.url)
            return EngineProcess(tiny_model_dir, tmp_path, *flags)

        with ThreadPoolExecutor(1) as pool:
            later = pool.submit(replace)
            try:
                model = hf_model(tiny_model_dir, seed=6)
                start = time.monotonic()
                report = run(keeper.sync(model.named_parameters(), 2))
                took = time.monotonic() - start
            finally:
                second = later.result()  # stopped below, also when the sync failed
        assert report.engines == [second.url] and list(report.removed) == [first.url]
        assert versions(second.url) == ["2"] and served_version(router.url) == "2"
        assert router_state(router.url) == ([second.url], "2", [second.url])
        ((waited, who),) = keeper.waits
        assert who == [second.url] and 2 < waited <= took < 60
        out = capsys.readouterr().out
        print(f"no engine: the sync waited {waited:.1f} s, finished after {took:.1f} s")
        assert out.count("[trainer] no engine left: waiting up to 60 s for one") == 1, out
        assert f"engine(s) ['{second.url}'] joined and hold version 2, after" in out, out

        # None for the whole --stall-timeout: the old error, after it.
        second.stop()
        short = EngineKeeper(ws, stall_timeout_s=2, poll_s=0.2)
        start = time.monotonic()
        with pytest.raises(NoEngineLeft, match=r"v3: no engine left to sync .*waited 2 s"):
            run(short.sync(model.named_parameters(), 3))
        assert 2 <= time.monotonic() - start < 15
        assert not short.ready.is_set()
    finally:
        run(ws.close())
        for proc in (first, second):
            if proc is not None:
                proc.stop()


def test_between_syncs_the_keeper_sees_the_engine_gone_and_catches_a_new_one_up(
    routers, tiny_model_dir: Path, tmp_path: Path, run, capsys
):
    """The engine dies while the trainer waits for a batch (no sync under way): the keeper's
    looks find the router routing to none, pause admission, and sync the engine registered
    next to the current version; the router routes to it only then."""
    router = routers(free_port(), "--health-check-interval", "0.5")
    first = EngineProcess(tiny_model_dir, tmp_path, *ENGINE_FLAGS)
    second = None
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=5, stall_timeout_s=60)
    keeper = EngineKeeper(ws, stall_timeout_s=60, poll_s=0.2)
    model = hf_model(tiny_model_dir, seed=7)
    weights = model.named_parameters  # the backend's named_weights: a callable
    lock = asyncio.Lock()

    async def scenario() -> tuple[float, float]:
        await keeper.sync(weights, 8, join=[first.url])
        looks = asyncio.create_task(keeper.run(weights, lambda: 8, lock))
        try:
            first.proc.kill()
            killed = time.monotonic()
            while keeper.ready.is_set():  # the keeper finds out and pauses admission
                assert time.monotonic() - killed < 30 and not looks.done()
                await asyncio.sleep(0.05)
            paused_after = time.monotonic() - killed
            nonlocal second
            flags = (*ENGINE_FLAGS, "--register-with", router.url)
            second = await asyncio.to_thread(EngineProcess, tiny_model_dir, tmp_path, *flags)
            await asyncio.wait_for(keeper.ready.wait(), 60)
            return paused_after, time.monotonic() - killed
        finally:
            looks.cancel()
            await asyncio.gather(looks, return_exceptions=True)
            await ws.close()

    try:
        capsys.readouterr()
        paused_after, resumed_after = run(scenario())
        assert second is not None and versions(second.url) == ["8"]
        assert router_state(router.url) == ([second.url], "8", [second.url])
        assert served_version(router.url) == "8"
        ((waited, who),) = keeper.waits
        assert who == [second.url]
        out = capsys.readouterr().out
        print(
            f"engine killed between syncs: admission paused after {paused_after:.1f} s, "
            f"resumed after {resumed_after:.1f} s (waited {waited:.1f} s with none)"
        )
        assert out.count("[trainer] no engine left: waiting up to 60 s for one") == 1, out
        assert f"engine(s) ['{second.url}'] joined and hold version 8" in out, out
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.stop()


def test_an_engine_stopped_through_a_sync_is_removed_and_taken_back_once_it_answers(
    routers, tiny_model_dir: Path, tmp_path: Path, run, capsys
):
    """The only engine SIGSTOPped as a sync starts (issue 42's chaos run: nothing ever
    re-admitted it): the sync removes it, waits with none left, and takes it back once it
    answers /health again (SIGCONT 4 s later), synced to the new version before the router
    routes to it."""
    import signal

    router = routers(free_port(), "--health-check-interval", "0.5")
    engine = EngineProcess(tiny_model_dir, tmp_path, *ENGINE_FLAGS)
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=2, stall_timeout_s=60)
    keeper = EngineKeeper(ws, stall_timeout_s=60, poll_s=0.2)
    try:
        run(keeper.sync(hf_model(tiny_model_dir, seed=8).named_parameters(), 1, join=[engine.url]))
        capsys.readouterr()
        engine.proc.send_signal(signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: (time.sleep(4), engine.proc.send_signal(signal.SIGCONT)))
            start = time.monotonic()
            report = run(keeper.sync(hf_model(tiny_model_dir, seed=9).named_parameters(), 2))
            took = time.monotonic() - start
        assert report.engines == [engine.url] and list(report.removed) == [engine.url]
        assert versions(engine.url) == ["2"] and served_version(router.url) == "2"
        assert router_state(router.url) == ([engine.url], "2", [engine.url])
        out = capsys.readouterr().out
        print(f"engine stopped through a sync: back at version 2 after {took:.1f} s")
        assert 4 < took < 30, out
        assert out.count("[trainer] no engine left: waiting up to 60 s for one") == 1, out
        assert f"engine(s) ['{engine.url}'] joined and hold version 2" in out, out
    finally:
        engine.proc.send_signal(signal.SIGCONT)
        run(ws.close())
        engine.stop()


def test_a_restarted_trainer_takes_back_the_engines_a_restarted_router_forgot(
    engines: list[EngineProcess], routers, tiny_model_dir: Path, redis_url: str, run
):
    """Trainer and router both restarted (issue 42's monkey, seed 1: the trainer killed at 510
    s, the router at 540 s): the router lists no engine, the new trainer never met it, and the
    engine joined once at its start. The run's engines are in Redis (EngineBook): the new
    trainer recalls them and its first sync takes the engine back at its version. Before: no
    engine for --stall-timeout, then `no engine left to sync`, the trainer exiting 1 again and
    again."""
    from millstream.common.keys import RunKeys
    from millstream.common.redis_conn import connect
    from millstream.trainer.weights.keeper import EngineBook

    keys = RunKeys(f"recall-{free_port()}")
    url = engines[0].url
    port = free_port()
    router = routers(port)
    redis = run(connect(redis_url))
    first = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, stall_timeout_s=60)
    try:
        keeper = EngineKeeper(first, stall_timeout_s=5, poll_s=0.2, book=EngineBook(redis, keys))
        run(keeper.sync(hf_model(tiny_model_dir, seed=3).named_parameters(), 1, join=[url]))
    finally:
        run(first.close())
    router.kill()  # and the trainer "restarts": a new WeightSync and keeper, no memory of it
    router = routers(port)
    assert router_state(router.url)[0] == []
    second = WeightSync(router.url, admin_token=TOKEN, timeout_s=20, stall_timeout_s=60)
    try:
        keeper = EngineKeeper(second, stall_timeout_s=5, poll_s=0.2, book=EngineBook(redis, keys))
        assert run(keeper.recall()) == [url]
        report = run(keeper.sync(hf_model(tiny_model_dir, seed=4).named_parameters(), 2))
        assert report.engines == [url]
        assert versions(url) == ["2"] and router_state(router.url) == ([url], "2", [url])
    finally:
        run(second.close())
        run(redis.aclose())
