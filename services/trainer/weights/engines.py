"""What the weight sync knows of each engine, kept between syncs: where it lives, what it is,
the ranks it takes, the weights it needs, and the route they take (routes/choose.py).

An engine says it in its /get_server_info, asked once (an engine removed is forgotten: a new
one may come back at its URL):
  * millstream's engine: `placement` (host, device, GPU) and `weight_transports` (the routes
    it takes, by any of their names: common/weight_routes.py);
  * a real SGLang server says neither; the launcher tells where it put the ones it started
    (`known`: LocalCluster.engine_placements). It says `tp_size` (the entries of a tensor
    update, one per TP rank) and `dp_size` (its ranks in an update group: tp x dp), and its
    `model_path`: an FP8-serialized checkpoint there means the trainer casts the weights it
    quantizes to FP8 first (fp8_weights.py). One whose FP8 weights the trainer cannot make
    (a scheme it does not write, a checkpoint it cannot read) is `refused`, with why: sending
    it full-precision weights would load wrong weights without an error.

The route of each engine is printed when it is first chosen or changes, with why:
    [trainer] weight transport to URL: tensor in SGLang's format over CUDA IPC (an SGLang
    server on the trainer's GPU); FP8 checkpoint: the trainer casts 28 weights to e4m3 ...
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from millstream.common import tensor_share
from millstream.common.weight_routes import NCCL

from . import fp8_weights
from .calls import EngineCalls
from .routes import sglang_format
from .routes.base import Route
from .routes.choose import choose
from .routes.nccl import engine_ranks


class EngineBook:
    """Per engine URL: placement, kind, ranks, FP8 layout, route (module docstring)."""

    def __init__(self, setting: str, known: Mapping[str, dict[str, Any]] | None = None):
        # --update-weight-transport as the config holds it: `auto` or a route's one name
        self.setting = setting
        self._known = dict(known or {})
        self.placements: dict[str, dict[str, Any] | None] = {}  # None: it does not say
        self.ranks: dict[str, int] = {}  # in an update group
        self.tp: dict[str, int] = {}  # SGLang servers: entries of a tensor update
        self.sglang: set[str] = set()  # real SGLang servers
        self.fp8: dict[str, fp8_weights.Fp8Layout] = {}
        self.refused: dict[str, str] = {}
        self.routes: dict[str, Route] = {}
        # Engines whose tensor update could not open millstream's handle: the group's now.
        self.moved_to_group: set[str] = set()

    async def route(
        self, calls: EngineCalls, engines: list[str], trainer: dict[str, Any]
    ) -> dict[str, Route]:
        """The route of each of `engines` from a trainer at `trainer`; new ones are asked
        where they live first. TransportError for a forced route that cannot reach one."""
        new = [u for u in engines if u not in self.placements]
        if new:
            found = await asyncio.gather(*(self._probe(calls, u) for u in new))
            self.placements |= dict(zip(new, found, strict=True))
        if any(self._sglang_on(trainer, u) for u in engines):
            await asyncio.to_thread(sglang_format.unavailable)  # a slow import, off the loop
        routes = {}
        for url in engines:
            if url in self.moved_to_group:
                route = Route(NCCL, "its tensor update could not open the handle")
            else:
                place = self.placements[url]
                route = choose(self.setting, trainer, place, sglang_format.unavailable)
            if self.routes.get(url) != route:
                print(
                    f"[trainer] weight transport to {url}: {route}{self._weights(url)}", flush=True
                )
            routes[url] = route
        self.routes = routes
        return routes

    def forget(self, url: str) -> None:
        """A removed engine: a new one may come back at this URL."""
        self.placements.pop(url, None)
        self.moved_to_group.discard(url)
        self.sglang.discard(url)
        self.fp8.pop(url, None)
        self.refused.pop(url, None)

    def _sglang_on(self, trainer: dict[str, Any], url: str) -> bool:
        place = self.placements.get(url)
        return (
            place is not None
            and "weight_transports" not in place
            and tensor_share.same_gpu(trainer, place)
        )

    def _weights(self, url: str) -> str:
        if url in self.refused:
            return f"; refused: {self.refused[url]}"
        return f"; {self.fp8[url]}" if url in self.fp8 else ""

    async def _probe(self, calls: EngineCalls, url: str) -> dict[str, Any] | None:
        """Where an engine lives and which transports it takes (None: nobody says)."""
        info = await calls.info(url)
        if info is not None:
            self.ranks[url] = engine_ranks(info)
        place = info.get("placement") if info is not None else None
        if isinstance(place, dict):
            assert info is not None
            return {**place, "weight_transports": list(info.get("weight_transports", []))}
        if info is not None or url in self._known:  # says nothing of itself: SGLang
            self.sglang.add(url)
        if info is not None:
            self.tp[url] = _positive(info.get("tp_size"))
            try:
                layout = await asyncio.to_thread(fp8_weights.layout_of, info)
            except (ValueError, OSError) as err:
                self.refused[url] = f"an FP8 SGLang server whose weights cannot be made: {err}"
            else:
                if layout is not None:
                    self.fp8[url] = layout
        return self._known.get(url)


def _positive(value: Any) -> int:
    try:
        return max(1, int(value or 1))
    except (TypeError, ValueError):
        return 1
