"""The nccl route of a weight sync (sync.py step 3): rank 0 of the weight-update group, kept
from sync to sync, and what it does when the group breaks. `nccl` is Miles' name for it; the
group's collective backend is NCCL when the trainer and every engine in it are on GPUs, gloo
when any of them is on a CPU (`group_backend`; the trainer's tensors then go through its CPU).

    group    when there is none or membership changed: destroy the old one (rank 0 and, best
             effort, the engines), then every engine /init_weights_update_group {master
             address, a fresh port, rank_offset (1 + the ranks of the engines before it: one
             per GPU, SGLang's tp_size x dp_size), world_size 1 + all ranks} while rank 0 joins;
    buckets  for each bucket: every engine /update_weights_from_distributed {names, dtypes,
             shapes, group_name, load_format} concurrently with rank 0's broadcast of it: one
             broadcast of its bytes (flattened_bucket, the default) or one per tensor;
             weight_version and flush_cache go with the last bucket only.

Group names are unique to this trainer process (`_instance`): an engine that outlived a killed
trainer still holds its groups, and a restarted trainer's `_1` would collide with them. Every
collective is bounded by the group's timeout and runs in a thread, so the event loop keeps
serving the engines' HTTP calls meanwhile.

Each group is written down (`ledger`, rendezvous.py) before its init is posted, marked formed
once rank 0 joined, and struck off when dropped: an SGLang server whose trainer was killed
between the POST and its connection stays blocked for 30 minutes, and a trainer that starts
again frees it from that record (`release`).

When a step breaks (rank 0's join or a broadcast fails), the group is torn down on both sides,
rebuilt with the engines still standing, and every bucket is sent again, so the same sync
completes for the healthy engines. Blame (`blame`): in one collective, a peer that is missing
makes everyone else wait and time out, so failing is not proof of fault. At fault are, in
order: engines that failed and then do not answer (calls.py `alive`: dead or hung); else
engines that failed while rank 0 or another engine succeeded; else, when all failed, those
that failed early (before half the timeout: they refused, the rest waited on them). When all
failed alike, nobody is removed: the group is rebuilt once, and a second such failure points
at rank 0 (e.g. engines cannot reach --master-address) and raises MillstreamError. A paused
SGLang server answers /get_server_info, not /health (a generation): `alive` asks both, so an
SGLang server restarted at its URL (its group gone: "Group ... not in []") is not blamed as
dead, and the group is rebuilt with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from millstream.common import threads
from millstream.common.errors import MillstreamError
from millstream.common.weight_routes import NCCL

from ..calls import EngineCalls, Failure, SyncReport
from ..rendezvous import GroupLedger, GroupRecord, release
from .base import FLATTENED_BUCKET, Bucket, Push, Remove, Sender, on_cpu
from .process_group import UpdateGroup

if TYPE_CHECKING:
    from ..router_admin import RouterAdmin

log = logging.getLogger("millstream.trainer")


class GroupBroken(Exception):
    """One step of the update group failed somewhere: on rank 0 and/or on some engines."""

    def __init__(self, step: str, rank0: BaseException | None, failed: dict[str, Failure]):
        self.step, self.rank0, self.failed = step, rank0, failed
        where = [f"rank 0: {type(rank0).__name__}: {rank0}"] if rank0 else []
        where += [f"{url}: {why}" for url, why in failed.items()]
        super().__init__(f"{step} failed ({'; '.join(where)})")


def group_layout(ranks: Sequence[int]) -> tuple[list[int], int]:
    """(each engine's rank_offset, the group's world size) for engines taking `ranks` ranks
    each, after the trainer's rank 0: [1, 1, 1] -> ([1, 2, 3], 4); [2, 2] -> ([1, 3], 5)."""
    offsets = list(itertools.accumulate([1, *ranks[:-1]])) if ranks else []
    return offsets, 1 + sum(ranks)


def engine_ranks(info: Mapping[str, Any]) -> int:
    """The ranks an engine takes in an update group, from its /get_server_info: one per GPU,
    SGLang's tp_size x dp_size (1 where it does not say)."""
    try:
        return max(1, int(info.get("tp_size") or 1)) * max(1, int(info.get("dp_size") or 1))
    except (TypeError, ValueError):
        return 1


def group_backend(trainer: Mapping[str, Any], engines: Sequence[Mapping[str, Any] | None]) -> str:
    """NCCL when the trainer and every engine of the group are on GPUs, else gloo (the
    trainer's tensors then go through its CPU). An engine that says nothing of where it lives
    (real SGLang) is taken to be where the trainer is, as before transports were chosen."""
    if on_cpu(trainer):
        return "gloo"
    return "gloo" if any(e is not None and on_cpu(e) for e in engines) else "nccl"


def _in_daemon_thread(fn: Callable[[], None]) -> asyncio.Future[None]:
    """`fn()` in a daemon thread of its own; the future settles on the calling loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            fn()
        except BaseException as err:
            error = err
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="weight-sync-rendezvous", daemon=True).start()
    return future


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Take an abandoned rank-0 step's outcome, so asyncio does not report it as lost."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("abandoned rank-0 step ended: %s", task.exception())


class GroupRoute(Sender):
    """Rank 0 of the weight-update group across syncs (module docstring); `backend`: the
    collective backend forced (None: by where the members live, `group_backend`)."""

    name = NCCL
    sessions = True

    def __init__(
        self,
        *,
        master_address: str,
        group_name: str,
        load_format: str | None,
        timeout_s: float,
        remove: Remove,
        backend: str | None = None,
    ):
        self.backend = backend
        self.master_address = master_address
        self.group_name = group_name
        self.load_format = load_format
        self.timeout_s = timeout_s
        self._remove = remove
        self.group: UpdateGroup | None = None
        self.members: list[str] = []  # the engines of `group`, in rank order
        self._generation = itertools.count(1)
        self._instance = secrets.token_hex(3)
        self.ledger: GroupLedger | None = None  # where each group is written down (Redis)

    async def send(self, push: Push, engines: list[str], buckets: Sequence[Bucket]) -> list[str]:
        """Every bucket to `engines` through the group (`push` below)."""
        if not engines:
            return []
        placements = [push.engines.placements.get(u) for u in engines]
        backend = self.backend or group_backend(push.trainer, placements)
        return await self.push(
            push.calls, push.router, engines, buckets, backend, push.engines.ranks, push.report
        )

    async def push(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        engines: list[str],
        buckets: Sequence[Bucket],
        backend: str,
        ranks: Mapping[str, int],
        report: SyncReport,
    ) -> list[str]:
        """Every bucket to `engines` through the group (`ranks`: each engine's), rebuilding a
        broken group with the engines still standing; the engines that hold the buckets."""
        unexplained = 0
        while True:
            if not engines:
                return []  # every one removed: sync() says so if no other route synced one
            try:
                group = self.group
                if group is None or self.members != engines or group.backend != backend:
                    group = await self._rebuild(calls, engines, backend, ranks, report)
                await self._send(calls, group, engines, buckets, report)
                return engines
            except GroupBroken as broken:
                log.warning("weight sync v%d: %s; rebuilding the group", report.version, broken)
                start = time.monotonic()
                culprits = await self.blame(calls, broken, engines)
                await self.drop(calls, [u for u in engines if u not in culprits])
                unexplained = 0 if culprits else unexplained + 1
                if unexplained > 1:
                    raise MillstreamError(
                        f"weight sync v{report.version}: {broken}, twice, and no engine is at "
                        f"fault: can the engines reach rank 0 at {self.master_address} "
                        "(--master-address)? Is the collective backend usable?"
                    ) from broken
                engines = await self._remove(router, engines, culprits, report)
                report.attempts += 1
                report.add_time("recover", time.monotonic() - start)

    async def _rebuild(
        self,
        calls: EngineCalls,
        engines: list[str],
        backend: str,
        ranks: Mapping[str, int],
        report: SyncReport,
    ) -> UpdateGroup:
        start = time.monotonic()
        # Old members that left between syncs are asked too: they may still hold the group.
        await self.drop(calls, [u for u in self.members if u not in report.removed])
        name = f"{self.group_name}_{self._instance}_{next(self._generation)}"
        # Engine i's ranks follow the ranks of those before it (an SGLang server with tp 2
        # joins as rank_offset and rank_offset + 1), after the trainer's rank 0.
        offsets, world = group_layout([ranks.get(u, 1) for u in engines])
        group = UpdateGroup(name, world, backend, self.master_address, self.timeout_s)
        self.group, self.members = group, list(engines)
        record = GroupRecord(self.master_address, group.port, name, world, list(engines))
        await self._note(record)  # before the POST: after it, a crash can block an engine

        def body(i: int, _url: str) -> dict[str, Any]:
            return {
                "master_address": self.master_address,
                "master_port": group.port,
                "rank_offset": offsets[i],
                "world_size": group.world_size,
                "group_name": name,
                "backend": backend,
            }

        try:
            await self.step(
                calls, "/init_weights_update_group", engines, body, group.join, early_out=True
            )
        finally:
            report.add_time("init", time.monotonic() - start)
        await self._note(record.formed())
        report.new_group = True
        log.info(
            "weight sync v%d: update group %r of %d (%s, port %d) in %.2fs",
            report.version, name, group.world_size, backend, group.port,
            time.monotonic() - start,
        )  # fmt: skip
        return group

    async def _send(
        self,
        calls: EngineCalls,
        group: UpdateGroup,
        engines: list[str],
        buckets: Sequence[Bucket],
        report: SyncReport,
    ) -> None:
        start = time.monotonic()
        flattened = self.load_format == FLATTENED_BUCKET
        try:
            for k in range(len(buckets)):
                bucket = await threads.compute(buckets.__getitem__, k)  # FP8: cast on reading
                body = {**bucket.spec(), "group_name": group.name, "flush_cache": False}
                if flattened:
                    body["load_format"] = FLATTENED_BUCKET
                if k == len(buckets) - 1:
                    body.update(weight_version=str(report.version), flush_cache=report.flush_cache)
                await self.step(
                    calls,
                    "/update_weights_from_distributed",
                    engines,
                    lambda _i, _u, body=body: body,
                    lambda bucket=bucket, flat=flattened: group.broadcast(bucket.tensors, flat),
                    label=f"bucket {k + 1}/{len(buckets)}",
                )
        finally:
            report.add_time("broadcast", time.monotonic() - start)

    async def step(
        self,
        calls: EngineCalls,
        path: str,
        engines: list[str],
        body: Callable[[int, str], dict[str, Any]],
        rank0: Callable[[], None],
        label: str = "",
        early_out: bool = False,
    ) -> None:
        """Call `path` on every engine while rank 0 runs its side in a thread.

        `early_out` (the group's rendezvous): an engine that answered with an error will
        never join, and rank 0 would wait out the whole timeout for it. Stop waiting at once
        instead; the abandoned rendezvous ends on its own timeout in its thread, and the group
        is rebuilt without the engine (a broadcast is never abandoned: its group is in use)."""
        # A rendezvous may be abandoned: it runs in a daemon thread of its own, since
        # asyncio.run waits at exit for every thread of the loop's executor.
        rank0_task = _in_daemon_thread(rank0) if early_out else threads.compute(rank0)
        rank0_task = asyncio.ensure_future(rank0_task)
        try:
            failed = await calls.each(engines, path, body)
        except BaseException:
            rank0_task.add_done_callback(_retrieve)
            raise
        if early_out and failed and not rank0_task.done():
            rank0_task.add_done_callback(_retrieve)
            raise GroupBroken(f"{path} {label}".strip(), None, failed)
        (rank0_result,) = await asyncio.gather(rank0_task, return_exceptions=True)
        rank0_error = rank0_result if isinstance(rank0_result, BaseException) else None
        if rank0_error is not None and not isinstance(rank0_error, Exception):
            raise rank0_error
        if rank0_error is not None or failed:
            raise GroupBroken(f"{path} {label}".strip(), rank0_error, failed)

    async def blame(
        self, calls: EngineCalls, broken: GroupBroken, engines: list[str]
    ) -> dict[str, str]:
        """The engines at fault for a broken group step (module docstring)."""
        failed = broken.failed
        alive = await calls.alive(list(failed))
        dead = {
            u: f"{f}; then no answer to /health or /get_server_info"
            for u, f in failed.items()
            if u not in alive
        }
        if dead:
            return dead
        if broken.rank0 is None or len(failed) < len(engines):
            return {u: str(f) for u, f in failed.items()}
        # Everyone failed: the ones that gave up early broke ranks, the rest waited on them.
        early = {u: str(f) for u, f in failed.items() if f.seconds < self.timeout_s / 2}
        return early if len(early) < len(failed) else {}

    async def drop(self, calls: EngineCalls, notify: list[str]) -> None:
        """Leave the group on rank 0 and tell `notify` to (best effort); none is kept."""
        group, self.group, self.members = self.group, None, []
        if group is None:
            return
        await asyncio.to_thread(group.destroy)
        await self._note(None)
        failed = await calls.each(
            notify, "/destroy_weights_update_group", lambda _i, _u: {"group_name": group.name}
        )
        for url, why in failed.items():
            log.info("leaving update group %r on %s failed (ignored): %s", group.name, url, why)

    async def _note(self, record: GroupRecord | None) -> None:
        if self.ledger is not None:
            await self.ledger.note(record)

    async def release(self, calls: EngineCalls, record: GroupRecord) -> str:
        """An earlier trainer's group (rendezvous.py): free its engines blocked in the
        rendezvous, then ask the ones that answer to destroy it (best effort); what happened,
        in one line."""
        start = time.monotonic()
        freed, stuck, why = await release(calls.http, record)
        answering = await calls.alive(record.engines)
        gone = await calls.each(
            [u for u in record.engines if u in answering and u not in stuck],
            "/destroy_weights_update_group",
            lambda _i, _u: {"group_name": record.name},
        )
        for url, failure in gone.items():  # it never formed there, or the server restarted
            log.info("destroying update group %r on %s: %s (ignored)", record.name, url, failure)
        line = (
            f"an earlier trainer's update group {record.name!r} ({record.phase}, "
            f"{record.address}:{record.port}): "
        )
        if freed:
            line += (
                f"freed {freed}, blocked in its rendezvous, in {time.monotonic() - start:.1f} s; "
            )
        if stuck:
            line += (
                f"{stuck} stay blocked in its rendezvous ({why}) until SGLang's own 30-minute "
                "timeout; "
            )
        return line + "the group is destroyed on the engines that answer"
