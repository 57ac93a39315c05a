"""Step 2 and 3 of a weight sync (sync.py): every engine its buckets, each by its route, the
routes side by side.

    routes   each engine's (engines.py, transport.py): group, tensor (millstream's handle or
             SGLang's format), disk
    refuse   an SGLang server whose FP8 weights cannot be made (engines.py `refused`)
    session  /begin_weight_update on every SGLang server on the tensor or group route
             (sglang_route.py: SGLang 0.5.23 takes those updates only inside one; one
             without the endpoint goes without)
    push     group (group_route.py), tensor (transport.push_tensors; sglang_route.push_sglang
             for SGLang servers), disk (transport.push_disk), concurrently
    session  /end_weight_update on the SGLang servers that took the buckets

Weights: the buckets as the trainer holds them, except for a route with an FP8 SGLang server
on it, which gets them quantized to its checkpoint's layout (fp8_weights.py: every bucket cast
when the route reaches it). All engines of one run serve one checkpoint, so one layout; an
update group shared with millstream's engine hands that engine the same FP8 weights and
scales, which it takes for its FP8 Linears (engine/fp8.py).

An engine that fails any of it is removed from routing (sync.py `_remove`) and named in the
report; the rest go on. An engine whose tensor update could not open millstream's handle is
served by the group instead, in this sync already.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from millstream.common import tensor_share
from millstream.common.errors import MillstreamError

from . import sglang_route
from .calls import EngineCalls, SyncReport
from .engines import EngineBook
from .fp8_weights import Fp8Buckets
from .group_route import GroupRoute, Remove
from .process_group import Bucket
from .transport import (
    DISK,
    GROUP,
    SGLANG_BYTES,
    SGLANG_HANDLES,
    TENSOR,
    group_backend,
    opening_failed,
    push_disk,
    push_tensors,
    trainer_placement,
)

if TYPE_CHECKING:
    from .router_admin import RouterAdmin

log = logging.getLogger("millstream.trainer")


class Delivery:
    """Every engine its buckets by its route (module docstring); keeps the update group, the
    engines' book and the shared-memory buffer from sync to sync."""

    def __init__(
        self,
        book: EngineBook,
        group: GroupRoute,
        remove: Remove,
        *,
        backend: str | None,
        disk_dir: Path | None,
        shm_dir: str,
    ):
        self.book, self.group = book, group
        self._remove = remove
        self.backend = backend  # forced collective backend (None: by the members' devices)
        self.disk_dir = disk_dir
        self._shm = tensor_share.ShmBuffer(shm_dir)  # the tensor route's file, kept

    async def push(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        engines: list[str],
        buckets: list[Bucket],
        report: SyncReport,
    ) -> list[str]:
        """The engines that hold the new version now (module docstring)."""
        trainer = trainer_placement(buckets)
        routes = await self.book.route(calls, engines, trainer)
        refused = {u: self.book.refused[u] for u in engines if u in self.book.refused}
        engines = await self._remove(router, engines, refused, report)
        group = [u for u in engines if routes[u].transport == GROUP]
        mine = {
            u: r
            for u, r in routes.items()
            if r.transport == TENSOR and r.handle not in SGLANG_HANDLES
        }
        sglang = [u for u in engines if routes[u].handle in SGLANG_HANDLES]
        disk = [u for u in engines if routes[u].transport == DISK]
        if not group and self.group.group is not None:  # nobody in it any more
            await self.group.drop(calls, self.group.members)
        sessions = [u for u in group + sglang if u in self.book.sglang]
        opened, failed = await sglang_route.open_sessions(calls, sessions)
        await self._remove(router, sessions, failed, report)
        group = [u for u in group if u not in failed]
        sglang = [u for u in sglang if u not in failed]
        fp8 = self._fp8(buckets, engines)
        done = await asyncio.gather(
            self._push_group(calls, router, group, fp8(group), trainer, report),
            self._push_tensor(calls, router, mine, buckets, report),
            self._push_sglang(calls, router, sglang, fp8(sglang), report),
            self._push_disk(calls, router, disk, fp8(disk), report),
        )
        synced = [u for part in done for u in part]
        moved = sorted(self.book.moved_to_group & set(mine))
        if moved:
            synced = [u for u in synced if u not in group]
            synced += await self._push_group(
                calls, router, group + moved, fp8(group + moved), trainer, report
            )
        return await self._close(calls, router, synced, opened, report)

    def _fp8(self, buckets: list[Bucket], engines: list[str]) -> Any:
        """For a route's engines: the buckets they take (FP8 ones when an FP8 SGLang server is
        among them)."""
        layouts = {self.book.fp8[u] for u in engines if u in self.book.fp8}
        if len(layouts) > 1:
            raise MillstreamError(
                "weight sync: the SGLang servers serve different FP8 checkpoints "
                f"({sorted(layout.source for layout in layouts)}); one run serves one"
            )
        quantized = Fp8Buckets(buckets, layouts.pop()) if layouts else None

        def pick(urls: list[str]) -> Sequence[Bucket]:
            takes_fp8 = quantized is not None and any(u in self.book.fp8 for u in urls)
            return quantized if takes_fp8 and quantized is not None else buckets

        return pick

    async def _close(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        synced: list[str],
        opened: list[str],
        report: SyncReport,
    ) -> list[str]:
        """End the sessions opened: the synced engines' (a failure removes the engine), and,
        best effort, those of engines removed meanwhile."""
        if not opened:
            return synced
        failed = await sglang_route.close_sessions(calls, opened)
        for url in [u for u in failed if u not in synced]:
            log.info("weight sync v%d: closing %s's session failed (ignored)", report.version, url)
        return await self._remove(
            router, synced, {u: w for u, w in failed.items() if u in synced}, report
        )

    async def _push_group(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        engines: list[str],
        buckets: Sequence[Bucket],
        trainer: dict[str, Any],
        report: SyncReport,
    ) -> list[str]:
        if not engines:
            return []
        placements = [self.book.placements.get(u) for u in engines]
        backend = self.backend or group_backend(trainer, placements)
        return await self.group.push(
            calls, router, engines, buckets, backend, self.book.ranks, report
        )

    async def _push_tensor(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        routes: dict[str, Any],
        buckets: list[Bucket],
        report: SyncReport,
    ) -> list[str]:
        if not routes:
            return []
        start = time.monotonic()
        failed = await push_tensors(
            calls, routes, buckets, report.version, self._shm, report.flush_cache
        )
        report.add_time("tensor", time.monotonic() - start)
        for url, why in failed.items():
            if opening_failed(why):
                log.warning(
                    "weight sync v%d: %s could not open the shared bucket (%s); the update "
                    "group serves it from now on", report.version, url, why,
                )  # fmt: skip
                self.book.moved_to_group.add(url)
        moved = self.book.moved_to_group
        removed = {u: why for u, why in failed.items() if u not in moved}
        return await self._remove(router, [u for u in routes if u not in moved], removed, report)

    async def _push_sglang(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        engines: list[str],
        buckets: Sequence[Bucket],
        report: SyncReport,
    ) -> list[str]:
        if not engines:
            return []
        start = time.monotonic()
        failed: dict[str, object] = {}
        for handle in SGLANG_HANDLES:  # CUDA IPC, then the bytes (servers on the CPU)
            mine = [u for u in engines if self.book.routes[u].handle == handle]
            if mine:
                tp_sizes = {u: self.book.tp.get(u, 1) for u in mine}
                failed |= await sglang_route.push_sglang(
                    calls, tp_sizes, buckets, report.version, report.flush_cache,
                    to_host=handle == SGLANG_BYTES,
                )  # fmt: skip
        report.add_time("tensor", time.monotonic() - start)
        return await self._remove(router, engines, failed, report)

    async def _push_disk(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        engines: list[str],
        buckets: Sequence[Bucket],
        report: SyncReport,
    ) -> list[str]:
        if not engines:
            return []
        if self.disk_dir is None:
            raise MillstreamError(
                f"weight sync v{report.version}: {engines} take weights from disk, and no "
                "--update-weight-disk-dir is set"
            )
        start = time.monotonic()
        failed = await push_disk(
            calls, engines, buckets, report.version, self.disk_dir, report.flush_cache
        )
        report.add_time("disk", time.monotonic() - start)
        return await self._remove(router, engines, failed, report)

    def close(self) -> None:
        self._shm.close()
