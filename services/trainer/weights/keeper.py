"""Keeping the run's engines: after a router restart, and when none is left.

What it owns: whether the trainer has an engine to generate with (`ready`, which admission
waits on) and the wait for one. It works in two places:

  * `sync(weights, version)`: the loop's weight sync, given the Coordinator's pending joins.
    When the sync finds no engine left (NoEngineLeft: the router listed none, or each one
    failed a step) it waits for one, then runs the same sync again: the newcomer gets the
    version before any request reaches it (the router gates on it);
  * `run(weights, version, lock)`: between syncs (it holds `lock`, which the loop holds while
    it trains and syncs), a look every `poll_s`. A router that restarted is told again what
    it forgot (WeightSync.readmit); a router that routes to no engine at two looks in a row
    gets a catch-up sync of the current version to what can take it (engines asking to join,
    listed engines that answer and are behind), waiting first when none answers. A listed
    engine that answers with the current version gets none: the router's view of it lags (a
    busy engine late to its health checks), and a sync would pause it for nothing.

Each sync also takes back the engines an earlier sync removed that answer again
(WeightSync.revivable: a stopped or slow engine that outlived its failure), so none is lost
for good.

The wait: admission paused (`ready` cleared) and one line that says so and how to add an
engine; then every `poll_s` the Coordinator's pending joins, the removed engines that answer
again (every one at each look: `revivable(eager=True)`) and the engines the router lists that
answer (calls.py `alive`; one registered with the router). The first found is synced to the
current version, admission resumes, and one line says after how long. Nothing found within
--stall-timeout of the loss: NoEngineLeft, the sync's own message plus the wait.

Why the trainer, and not the router or the engines, brings engines back: it already owns
membership (every engine in routing was synced by it) and the version, so an engine it adds
back is gated and synced by the same handshake; see docs/weight-sync.md. A trainer that
restarts has forgotten them, and a router that restarted too lists none: every engine synced is
also recorded in Redis (`EngineBook`, the run's `engines` set), which a starting trainer reads
(`recall`) and looks at as it looks at engines it removed. Next to it, the run's update group
(`EngineBook.group`, rendezvous.py): a trainer killed between posting a group's init and an
SGLang server connecting to it leaves that server blocked for 30 minutes, and `recall` frees it
before the first sync.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from millstream.common.keys import RunKeys

from ..observe.watch import Stalled
from .rendezvous import GroupLedger
from .sync import NoEngineLeft, SyncReport

log = logging.getLogger(__name__)


class EngineBook:
    """The engines this run's trainers synced, in Redis (`RunKeys.engines`), so a trainer that
    starts after a restart knows them even when the router restarted too and lists none: the
    engine joined through the Coordinator once, at its own start, and asks again only when it
    restarts. A bookkeeping write that fails is logged, never a failed sync."""

    def __init__(self, redis: Any, keys: RunKeys):
        self.redis, self.key = redis, keys.engines
        self._noted: set[str] = set()
        self.group = GroupLedger(redis, keys.update_group)  # the run's update group

    async def known(self) -> list[str]:
        return sorted(
            u.decode() if isinstance(u, bytes) else u for u in await self.redis.smembers(self.key)
        )

    async def note(self, urls: Sequence[str]) -> None:
        new = [u for u in urls if u not in self._noted]
        if not new:
            return
        try:
            await self.redis.sadd(self.key, *new)
        except Exception as err:  # the sync happened: only the record of it is missing
            log.warning("could not record engines %s in %s: %s", new, self.key, err)
            return
        self._noted.update(new)


class NoEngineInTime(NoEngineLeft, Stalled):
    """No engine came within --stall-timeout: the run's summary says "stall timeout"."""


def _say(line: str) -> None:
    print(f"[trainer] {line}", flush=True)


class EngineKeeper:
    def __init__(
        self,
        sync: Any,  # a WeightSync (or observe/prom.py's TimedSync around one)
        joins: Callable[[], Sequence[str]] = tuple,
        *,
        stall_timeout_s: float,
        coordinator_address: str | None = None,
        poll_s: float = 1.0,
        say: Callable[[str], None] = _say,
        book: EngineBook | None = None,
    ):
        self.ws = sync
        self.book = book
        self.joins = joins
        self.stall_timeout_s = stall_timeout_s
        self.coordinator_address = coordinator_address
        self.poll_s = poll_s
        self.say = say
        self.ready = asyncio.Event()
        self.ready.set()
        self.waits: list[tuple[float, list[str]]] = []  # (seconds with no engine, who came)
        self._lost_at: float | None = None  # when the engines were found gone
        self._dry = 0  # looks in a row at which the router routed to no engine
        if book is not None:
            sync.record_groups(book.group)

    async def sync(
        self, weights: Any, version: int, *, join: Sequence[str] = (), **kwargs: Any
    ) -> SyncReport:
        """WeightSync.sync with the pending joins, waiting for an engine when none is left.
        `weights`: a callable (the backend's named_weights), or (name, tensor) pairs, kept
        for the sync that runs again."""
        if not callable(weights):
            weights = list(weights)
        join = [*join, *self.joins(), *await self.ws.revivable()]
        removed: dict[str, str] = {}  # by the attempts that found none left
        while True:
            try:
                report = await self.ws.sync(weights, version, join=join, **kwargs)
            except NoEngineLeft as err:
                removed |= err.removed
                join = await self._wait(str(err))
                continue
            report.removed = {**removed, **report.removed}
            self._back(report, version)
            if self.book is not None:
                await self.book.note(report.engines)
            return report

    async def recall(self) -> list[str]:
        """A starting trainer: the engines earlier starts of this run synced, for the next
        sync to take back if they answer (WeightSync.remember), after freeing those an earlier
        start left blocked in its update group's rendezvous (rendezvous.py). Returns them."""
        if self.book is None:
            return []
        record = await self.book.group.read()
        if record is not None:  # an earlier start's group: it may have left engines blocked
            self.say(await self.ws.release_group(record))
            await self.book.group.note(None)
        known = await self.book.known()
        self.ws.remember(known)
        return known

    async def run(self, weights: Any, version: Callable[[], int], lock: asyncio.Lock) -> None:
        """Look every `poll_s`, between the loop's syncs, until cancelled (module docstring)."""
        while True:
            await asyncio.sleep(self.poll_s)
            async with lock:
                await self.check(weights, version())

    async def check(self, weights: Any, version: int) -> SyncReport | None:
        """One look; the catch-up sync's report when one ran."""
        eligible = await self.ws.eligible_engines()
        if await self.ws.readmit():
            eligible = await self.ws.eligible_engines()
        if eligible is None or eligible:
            self._dry = 0
            return None
        self._dry += 1
        if self._dry < 2:  # one more look: the router's view of a busy engine may lag
            return None
        self._dry = 0
        join = [*self.joins(), *await self.ws.revivable()]
        if not join:
            held = await self.ws.versions(await self.ws.routed_engines(patient=True))
            if str(version) in held.values():
                return None  # one holds the version: the router's health view lags (a busy engine)
            if not any(v is not None for v in held.values()):
                join = await self._wait(
                    f"no engine left: the router {self.ws.router_url} routes to none"
                )
        return await self.sync(weights, version, join=join)

    async def _wait(self, why: str) -> list[str]:
        """Engines to sync: the pending joins, or [] once the router lists an engine that
        answers /health. Up to --stall-timeout from the loss, then NoEngineLeft(why)."""
        if self._lost_at is None:
            self._lost_at = time.monotonic()
            self.ready.clear()
            where = self.coordinator_address or "TRAINER_HOST:PORT"
            self.say(
                f"no engine left: waiting up to {self.stall_timeout_s:g} s for one; start one "
                f"with `millstream engine ... --coordinator {where}` or register it with the "
                f"router {self.ws.router_url} (POST /add_worker)"
            )
        else:  # the last one found failed its sync: do not hammer it
            await asyncio.sleep(self.poll_s)
        while True:
            join = [*self.joins(), *await self.ws.revivable(eager=True)]
            await self.ws.readmit()
            if join or await self.ws.alive(await self.ws.routed_engines(patient=True)):
                return join
            waited = time.monotonic() - self._lost_at
            if waited >= self.stall_timeout_s:
                raise NoEngineInTime(
                    f"{why}; waited {waited:.0f} s for an engine to join "
                    f"(--stall-timeout {self.stall_timeout_s:g})"
                )
            await asyncio.sleep(min(self.poll_s, self.stall_timeout_s - waited))

    def _back(self, report: SyncReport, version: int) -> None:
        if self._lost_at is None:
            return
        waited, self._lost_at = time.monotonic() - self._lost_at, None
        self.waits.append((waited, list(report.engines)))
        self.ready.set()
        self.say(
            f"engine(s) {report.engines} joined and hold version {version}, after {waited:.1f} s "
            "with none: admission resumes"
        )
