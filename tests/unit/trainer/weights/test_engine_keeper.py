"""The trainer's side of a router restart and of an engine-less run, without servers: the
router's admin calls ride out a router that is away (two lines, one wait shared by concurrent
calls, bounded by the patience), and the keeper waits for an engine when none is left, with
admission paused, and runs the sync again for the one that came. Real processes:
tests/integration/test_engines_come_back.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from millstream.common.errors import ServiceUnavailable
from millstream.trainer.weights.keeper import EngineKeeper
from millstream.trainer.weights.router_admin import RouterAdmin
from millstream.trainer.weights.sync import NoEngineLeft, SyncReport

URL = "http://router.test:1"


class FlakyRouter:
    """Refuses connections while `down`; answers with id `rid` otherwise."""

    def __init__(self) -> None:
        self.down = False
        self.rid = "first"
        self.status = 200
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        headers = {"x-millstream-router": self.rid}
        return httpx.Response(self.status, json={"urls": ["http://e:1"]}, headers=headers)


def admin(router: FlakyRouter, patience_s: float, lines: list[str]) -> RouterAdmin:
    http = httpx.AsyncClient(transport=httpx.MockTransport(router))
    return RouterAdmin(http, URL, None, timeout_s=1.0, patience_s=patience_s, say=lines.append)


def test_calls_wait_for_a_router_that_is_away_and_say_so_twice():
    router, lines = FlakyRouter(), []

    async def scenario() -> None:
        ra = admin(router, 30.0, lines)
        assert await ra.engines() == ["http://e:1"] and ra.router_id == "first"
        router.down = True

        async def back_later() -> None:
            await asyncio.sleep(0.6)
            router.down, router.rid = False, "second"

        start = time.monotonic()
        both = await asyncio.gather(ra.engines(), ra.engines(), back_later())
        assert both[:2] == [["http://e:1"], ["http://e:1"]]
        assert 0.5 < time.monotonic() - start < 5
        assert ra.restarts == 1 and ra.router_id == "second"

    asyncio.run(scenario())
    assert len(lines) == 2, lines  # one wait for both calls
    assert lines[0].startswith(f"waiting up to 30 s (--stall-timeout) for the router at {URL}")
    assert "GET /list_workers" in lines[0] and "ConnectError" in lines[0]
    assert lines[1].startswith(f"the router at {URL} answers again (away ")


def test_the_wait_ends_after_the_patience_and_a_4xx_is_not_retried():
    router, lines = FlakyRouter(), []

    async def scenario() -> None:
        ra = admin(router, 0.5, lines)
        router.down = True
        start = time.monotonic()
        with pytest.raises(ServiceUnavailable, match=r"GET /list_workers failed .*stall-timeout"):
            await ra.engines()
        assert 0.4 < time.monotonic() - start < 3
        with pytest.raises(ServiceUnavailable, match="ConnectError"):
            await ra.engines(patient=False)

        router.down, router.status, router.calls = False, 401, 0
        with pytest.raises(ServiceUnavailable, match="HTTP 401"):
            await ra.add("http://e:1")
        assert router.calls == 1

    asyncio.run(scenario())


class FakeSync:
    """A WeightSync whose engines come and go: `sync` fails with NoEngineLeft while there is
    none; `engines` are listed (and answer /health)."""

    router_url = URL

    def __init__(self) -> None:
        self.engines: list[str] = []
        self.eligible: list[str] | None = []
        self.synced: list[tuple[int, list[str]]] = []
        self.held: dict[str, str] = {}  # engine url -> the version it holds
        self.readmits = 0
        self.back: list[str] = []  # removed engines that answer again (`revivable`)

    async def sync(self, _weights: Any, version: int, *, join=(), **_: Any) -> SyncReport:
        self.engines += [u for u in join if u not in self.engines]
        if not self.engines:
            raise NoEngineLeft(f"weight sync v{version}: no engine left to sync")
        self.synced.append((version, list(self.engines)))
        self.held |= dict.fromkeys(self.engines, str(version))
        self.eligible = list(self.engines)
        return SyncReport(version, engines=list(self.engines))

    async def routed_engines(self, *, patient: bool = False) -> list[str]:
        return list(self.engines)

    async def alive(self, urls: list[str]) -> list[str]:
        return list(urls)

    async def versions(self, urls: list[str]) -> dict[str, str | None]:
        return {u: self.held.get(u, "0") for u in urls}

    async def eligible_engines(self) -> list[str] | None:
        return self.eligible

    async def readmit(self) -> list[str]:
        self.readmits += 1
        return []

    async def revivable(self, *, eager: bool = False) -> list[str]:
        back, self.back = self.back, []
        return back


def test_with_no_engine_the_sync_waits_pauses_admission_and_syncs_the_newcomer():
    ws, lines, joins = FakeSync(), [], []
    keeper = EngineKeeper(
        ws, lambda: joins[:] and [joins.pop()], stall_timeout_s=30, poll_s=0.02,
        coordinator_address="10.0.0.1:50051", say=lines.append,
    )  # fmt: skip

    async def scenario() -> None:
        async def join_later() -> None:
            await asyncio.sleep(0.3)
            assert not keeper.ready.is_set()  # admission paused meanwhile
            joins.append("http://new:1")

        report, _ = await asyncio.gather(keeper.sync([], 7), join_later())
        assert report.engines == ["http://new:1"] and keeper.ready.is_set()

    asyncio.run(scenario())
    assert ws.synced == [(7, ["http://new:1"])]
    assert len(lines) == 2, lines
    assert lines[0] == (
        "no engine left: waiting up to 30 s for one; start one with `millstream engine ... "
        f"--coordinator 10.0.0.1:50051` or register it with the router {URL} (POST /add_worker)"
    )
    assert lines[1].startswith("engine(s) ['http://new:1'] joined and hold version 7, after 0.")
    ((waited, who),) = keeper.waits
    assert 0.25 < waited < 3 and who == ["http://new:1"]


def test_with_no_engine_for_the_stall_timeout_the_old_error_is_raised():
    ws, lines = FakeSync(), []
    keeper = EngineKeeper(ws, stall_timeout_s=0.3, poll_s=0.02, say=lines.append)
    start = time.monotonic()
    with pytest.raises(NoEngineLeft, match=r"no engine left to sync; waited 0 s .*stall-timeout"):
        asyncio.run(keeper.sync([], 3))
    assert 0.25 < time.monotonic() - start < 3 and len(lines) == 1


def test_between_syncs_a_router_that_routes_to_none_twice_gets_a_catch_up_sync():
    ws, lines = FakeSync(), []
    ws.engines, ws.eligible = ["http://a:1"], []  # listed and answering, not routed (behind)
    keeper = EngineKeeper(ws, stall_timeout_s=30, poll_s=0.01, say=lines.append)

    async def scenario() -> None:
        assert await keeper.check([], 5) is None  # one look is not enough
        report = await keeper.check([], 5)
        assert report is not None and report.engines == ["http://a:1"]
        assert await keeper.check([], 5) is None  # routed now

    asyncio.run(scenario())
    assert ws.synced == [(5, ["http://a:1"])] and lines == []  # nothing waited: no line
    assert ws.readmits == 3


def test_between_syncs_an_engine_at_the_version_the_router_lags_on_is_left_alone():
    ws = FakeSync()
    ws.engines, ws.eligible, ws.held = ["http://a:1"], [], {"http://a:1": "5"}
    keeper = EngineKeeper(ws, stall_timeout_s=30, poll_s=0.01)

    async def scenario() -> None:
        for _ in range(4):
            assert await keeper.check([], 5) is None

    asyncio.run(scenario())
    assert ws.synced == [] and keeper.ready.is_set()


def test_a_removed_engine_that_answers_again_joins_the_next_sync_and_ends_a_wait():
    ws, lines = FakeSync(), []
    keeper = EngineKeeper(ws, stall_timeout_s=30, poll_s=0.02, say=lines.append)

    async def scenario() -> None:
        async def back_later() -> None:
            await asyncio.sleep(0.3)
            ws.back = ["http://stopped:1"]  # SIGCONT: it answers /health again

        report, _ = await asyncio.gather(keeper.sync([], 4), back_later())
        assert report.engines == ["http://stopped:1"] and keeper.ready.is_set()
        ws.back = ["http://other:1"]
        report = await keeper.sync([], 5)  # no wait: it simply joins
        assert report.engines == ["http://stopped:1", "http://other:1"]

    asyncio.run(scenario())
    assert ws.synced == [(4, ["http://stopped:1"]), (5, ["http://stopped:1", "http://other:1"])]
    assert lines[-1].startswith("engine(s) ['http://stopped:1'] joined and hold version 4")


# -- the trainer's start (Trainer._first_engines) --------------------------------------------


class StartParts:
    """What Trainer._first_engines touches: the FakeSync, a coordinator with pending joins,
    an admission that re-admits, a backend with weights."""

    def __init__(self, ws: FakeSync, joins: list[str]) -> None:
        self.weight_sync, self.joins, self.readmitted = ws, joins, []
        self.coordinator = self
        self.admission = self
        self.backend = self
        self.address = "10.0.0.1:50051"

    def take_pending_joins(self) -> list[str]:
        taken, self.joins[:] = list(self.joins), []
        return taken

    def named_weights(self) -> list:
        return []

    async def readmit(self, version: int) -> int:
        self.readmitted.append(version)
        return 3


def start_trainer(ws: FakeSync, joins: list[str], version: int, stall_s: float = 30):
    from millstream.common.config import parse_run_config
    from millstream.trainer.trainer import Trainer

    argv = ["--hf-checkpoint", "m", "--prompt-data", "p", "--rollout-batch-size", "2"]
    argv += ["--stall-timeout", str(stall_s)]
    cfg = parse_run_config(argv, mode="async", prog="test")
    trainer = Trainer.__new__(Trainer)  # only what the start needs
    trainer.cfg, trainer.p, trainer.version, trainer.iteration = (
        cfg,
        StartParts(ws, joins),
        version,
        9,
    )
    trainer.sync_at_start = trainer.readmit_at_start = False
    trainer.keeper = EngineKeeper(
        ws, trainer.p.take_pending_joins, stall_timeout_s=stall_s, poll_s=0.02,
        coordinator_address=trainer.p.address, say=lambda line: None,
    )  # fmt: skip
    return trainer


def test_a_resumed_trainer_with_no_engine_listed_waits_for_one_then_readmits(capsys):
    ws, joins = FakeSync(), []
    trainer = start_trainer(ws, joins, version=9)
    trainer.sync_at_start = trainer.readmit_at_start = True

    async def scenario() -> None:
        async def join_later() -> None:
            await asyncio.sleep(0.3)
            joins.append("http://new:1")

        await asyncio.gather(trainer._first_engines(), join_later())

    asyncio.run(scenario())  # before issue 42: NoEngineLeft at once
    assert ws.synced == [(9, ["http://new:1"])] and trainer.p.readmitted == [9]
    assert (
        "resumed at iteration 9 (version 9); re-admitted 3 groups in flight"
        in capsys.readouterr().out
    )


def test_a_resumed_trainer_with_no_engine_for_the_stall_timeout_stops_with_the_old_error():
    trainer = start_trainer(FakeSync(), [], version=9, stall_s=0.3)
    trainer.sync_at_start = True
    with pytest.raises(NoEngineLeft, match="waited 0 s"):
        asyncio.run(trainer._first_engines())


@pytest.mark.parametrize(
    ("held", "version", "synced"),
    [("7", 0, True), ("0", 0, False), ("default", 0, False), ("v0", 0, False),
     ("7", 7, False), ("6", 7, True), ("default", 7, True)],
)  # fmt: skip
def test_a_trainer_starts_by_syncing_the_engines_that_hold_another_version(
    held, version, synced, capsys
):
    ws = FakeSync()
    ws.engines, ws.held = ["http://old:1"], {"http://old:1": held}
    trainer = start_trainer(ws, [], version=version)
    asyncio.run(trainer._first_engines())
    assert ws.synced == ([(version, ["http://old:1"])] if synced else [])
    said = "hold weights of another version than this trainer's" in capsys.readouterr().out
    assert said == synced
