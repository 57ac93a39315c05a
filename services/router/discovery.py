"""Workers found by DNS: `--discover-workers HOST:PORT` (one or more), looked up every
`--discover-interval` seconds.

A real SGLang server cannot ask to join (millstream's engine can: --register-with,
--coordinator), and a replicated compose service is one DNS name: listed as one URL, each
connection would go to whichever replica the resolver picks, and the trainer's weight sync,
which pushes to every URL the router lists (trainer/weights/sync.py), would reach one replica
per sync. Docker's embedded DNS answers a service's name with the address of every running
replica, so each round makes every address a worker of its own, `http://IP:PORT`, through the
router's own add and remove paths (those of POST /add_worker and /remove_worker):

  * an address that answers GET /health and is not registered is added. It is `pending` until
    its first passed check and, once the trainer has synced a version, gated until it reports
    that version (registry.py): the trainer's next sync lists it, pushes the weights and
    vouches for it, and only then does it get traffic;
  * a worker whose address no longer resolves is removed, if this module added it;
  * a worker removed by someone else while its address still resolves (the trainer removes an
    engine that failed a sync step) is added again at the next round: a server that cannot ask
    to join would otherwise be lost for the rest of the run, and the gate keeps it out of
    routing until a sync brings it in;
  * a lookup that fails (no DNS server, a timeout) changes nothing for its name; a name that
    does not exist (NXDOMAIN: no replica running) resolves to no address.

Owns the set of URLs it added. Invariants: it never removes a worker it did not add
(--worker-urls, /add_worker); one round at a time; a failing round never ends the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from millstream.common import aio

from .registry import Registry, Worker

log = logging.getLogger("millstream.router")

Resolve = Callable[[str, int], Awaitable[list[str]]]
Target = tuple[str, int]

# What getaddrinfo says for a name that does not exist or has no address: no worker, not a
# failed lookup.
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_addresses(host: str, port: int) -> list[str]:
    """HOST's addresses (A and AAAA records, by the system resolver) in its order; [] for a
    name that does not exist; OSError for a lookup that failed."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in _NO_SUCH_NAME:
            return []
        raise
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def worker_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class Discovery:
    """Keeps one worker per address the targets resolve to (module docstring)."""

    def __init__(
        self,
        targets: Sequence[Target],
        interval: float,
        timeout: float,
        *,
        registry: Registry,
        add: Callable[[str], Awaitable[Any]],
        remove: Callable[[Worker], None],
        answers: Callable[[str], Awaitable[bool]],
        resolve: Resolve = resolve_addresses,
    ):
        self.targets = list(targets)
        self.interval = interval
        self.timeout = timeout  # for one lookup
        self.registry = registry
        self.add = add
        self.remove = remove
        self.answers = answers
        self.resolve = resolve
        self._found: dict[Target, set[str]] = {t: set() for t in self.targets}
        self._failing: dict[Target, str] = {}  # the last error, logged once until it changes
        self._added: set[str] = set()
        self._task: asyncio.Task | None = None

    @property
    def added(self) -> set[str]:
        """The URLs this discovery added and has not removed."""
        return set(self._added)

    async def discover(self) -> None:
        """One round: look every name up, remove the workers whose address left, add the
        addresses that answer and are not registered."""
        await asyncio.gather(*(self._look_up(t) for t in self.targets))
        wanted = set().union(*self._found.values())
        for url in sorted(self._added - wanted):
            self._added.discard(url)
            worker = self.registry.get(url)
            if worker is not None:
                self.remove(worker)
                log.warning("router: worker %s no longer resolves: removed", url)
        missing = sorted(url for url in wanted if self.registry.get(url) is None)
        up = await asyncio.gather(*(self.answers(url) for url in missing))
        for url, answered in zip(missing, up, strict=True):
            if not answered:
                continue
            await self.add(url)
            again = url in self._added
            self._added.add(url)
            log.info(
                "router: worker %s %s; it serves once it reports the expected weight version",
                url,
                "added again (removed while its address still resolves)" if again else "discovered",
            )

    async def _look_up(self, target: Target) -> None:
        host, port = target
        try:
            addresses = await aio.wait_for(self.resolve(host, port), self.timeout)
        except (OSError, TimeoutError) as err:
            why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            if self._failing.get(target) != why:
                log.warning(
                    "router: looking up %s:%d failed (%s); its workers stay as they are",
                    host, port, why,
                )  # fmt: skip
            self._failing[target] = why
            return
        if self._failing.pop(target, None) is not None:
            log.info("router: %s:%d resolves again", host, port)
        self._found[target] = {worker_url(address, port) for address in addresses}

    async def _loop(self) -> None:
        while True:
            try:
                await self.discover()
            except Exception:  # a bug here must not end discovery for good
                log.exception("router: a discovery round failed")
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
