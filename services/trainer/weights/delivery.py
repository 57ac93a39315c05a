"""Step 2 and 3 of a weight sync (sync.py): every engine its buckets, each by its route, the
routes side by side. One pass, the same for every route (routes/base.py `Sender`):

    routes   each engine's (engines.py, routes/choose.py): nccl, tensor (millstream's handle or
             SGLang's format), disk
    refuse   an SGLang server whose FP8 weights cannot be made (engines.py `refused`)
    session  /begin_weight_update on every SGLang server on a route that wants one (nccl and
             SGLang's format: routes/sglang_format.py; SGLang 0.5.23 takes those updates only
             inside one; one without the endpoint goes without)
    send     every route's sender its engines and their buckets, concurrently
    session  /end_weight_update on the SGLang servers that took the buckets

Weights: the buckets as the trainer holds them, except for a route with an FP8 SGLang server
on it, which gets them quantized to its checkpoint's layout (fp8_weights.py: every bucket cast
when the route reaches it). All engines of one run serve one checkpoint, so one layout; an
update group shared with millstream's engine hands that engine the same FP8 weights and
scales, which it takes for its FP8 Linears (engine/quant/fp8.py).

An engine that fails any of it is removed from routing (sync.py `_remove`) and named in the
report; the rest go on. An engine whose tensor update could not open millstream's handle is
served by the update group (the nccl route) instead, in this sync already.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import fp8_weights
from .calls import EngineCalls, SyncReport
from .engines import EngineBook
from .routes import sglang_format
from .routes.base import Bucket, Push, Remove, Sender
from .routes.choose import trainer_placement
from .routes.nccl import GroupRoute

if TYPE_CHECKING:
    from .router_admin import RouterAdmin

log = logging.getLogger("millstream.trainer")


class Delivery:
    """Every engine its buckets by its route (module docstring); `senders`: one per route
    (routes/choose.py `senders`), the update group's among them, kept from sync to sync with
    the engines' book."""

    def __init__(self, book: EngineBook, senders: Sequence[Sender], remove: Remove):
        self.book, self.senders, self._remove = book, tuple(senders), remove
        self.group = next(s for s in self.senders if isinstance(s, GroupRoute))

    async def push(
        self,
        calls: EngineCalls,
        router: RouterAdmin,
        engines: list[str],
        buckets: list[Bucket],
        report: SyncReport,
    ) -> list[str]:
        """The engines that hold the new version now (module docstring)."""
        book = self.book
        push = Push(calls, router, report, trainer_placement(buckets), book, self._remove)
        routes = await book.route(calls, engines, push.trainer)
        refused = {u: book.refused[u] for u in engines if u in book.refused}
        engines = await push.remove(engines, refused)
        on = {s: [u for u in engines if s.serves(routes[u])] for s in self.senders}
        if not on[self.group] and self.group.group is not None:  # nobody in it any more
            await self.group.drop(calls, self.group.members)
        sessions = [u for s in self.senders if s.sessions for u in on[s] if u in book.sglang]
        opened, failed = await sglang_format.open_sessions(calls, sessions)
        await push.remove(sessions, failed)
        on = {s: [u for u in urls if u not in failed] for s, urls in on.items()}
        take = fp8_weights.buckets_for(buckets, {u: book.fp8[u] for u in engines if u in book.fp8})
        done = await asyncio.gather(*(s.send(push, on[s], take(on[s])) for s in self.senders))
        synced = [u for part in done for u in part]
        group = on[self.group]
        in_group = set(group)
        moved = [u for u in engines if u in book.moved_to_group and u not in in_group]
        if moved:  # their tensor update could not open the handle: the group's now
            synced = [u for u in synced if u not in in_group]
            synced += await self.group.send(push, group + moved, take(group + moved))
        if opened:
            failed = await sglang_format.close_sessions(calls, opened)
            for url in [u for u in failed if u not in synced]:
                log.info(
                    "weight sync v%d: closing %s's session failed (ignored)", report.version, url
                )
            synced = await push.remove(synced, {u: w for u, w in failed.items() if u in synced})
        return synced

    def close(self) -> None:
        for sender in self.senders:
            sender.close()
