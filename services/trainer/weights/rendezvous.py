"""A trainer killed during the update group's rendezvous, the SGLang servers it leaves blocked,
and how a trainer that starts again frees them.

What a SIGKILLed rank 0 leaves an SGLang server (0.5.23, gloo on the CPU), by where it died,
measured in tests/sglang_live/test_faults.py:

  * after its POST /init_weights_update_group left, before SGLang's scheduler connected to rank
    0's TCPStore: the scheduler's store client dials the dead port again and again (torch's
    connect backoff, growing to a minute between tries) until torch's default_pg_timeout, 30
    minutes (SGLang's init_custom_process_group passes no timeout). Its scheduler is blocked
    all along: /generate, /health (a one-token generation) and /get_server_info hang;
    /model_info answers, so the router still sees its version;
  * after SGLang connected, before the group formed: free in about a second (the store's
    socket closes, SGLang's store call fails, so does the init);
  * during a broadcast: free in about a second (gloo sees its peer close); the weight-update
    session stays open, and the next sync closes it (routes/sglang_format.py `open_sessions`).

Only the first is a wedge, and no trainer can close its window from the inside: it is the time
from the POST leaving to SGLang's scheduler taking it up (milliseconds when idle, the rest of a
batch when busy, any time at all on a loaded machine).

The release: the blocked client keeps dialing the same address and port. Whoever binds that
port with a TCPStore gets the connection, and closing the store at once fails the client's
next call, as in the second case: the init fails and the scheduler is free. The port died
with the trainer, so rank 0 writes each group down (`GroupRecord`: address, port, name,
engines) before it posts the init, and marks it formed once joined (`GroupLedger`, in the
run's Redis next to the run's engines: keeper.EngineBook). A trainer that starts on the run
reads it (keeper.recall) and, for the recorded engines whose scheduler does not answer
(/get_server_info within PROBE_S), binds the port until they answer, each time closing as soon
as a client connected (`release`, at most HOLD_S: SGLang's client may wait up to a jittered
minute between tries); then it asks every recorded engine that answers to destroy the old
group, which would otherwise linger on it with a dead peer.

Why this, and not:
  * keeping rank 0's store alive past the trainer: SIGKILL runs no handler, and a store held by
    another process (a sidecar per group) costs a process start at every rebuild;
  * completing the old rendezvous (joining as rank 0 under the old name): it needs every rank
    back, and an engine that failed in the second case never comes; those that did would wait
    on it again. Closing needs nobody;
  * detection alone: an engine that does not answer is already removed from routing and taken
    back once it answers (routes/nccl.py `blame`, sync.py `revivable`), so a run goes on with its
    other engines or waits --stall-timeout for one; but the server stays blocked 30 minutes.
Limits: the release needs a trainer that starts again on the run (a restart, chaos, a redeploy)
on a machine that can bind the recorded address (the same host or service IP), within those 30
minutes, with the port still free; otherwise the line it prints says the server stays blocked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

import httpx

from millstream.common import aio

log = logging.getLogger("millstream.trainer")

RENDEZVOUS, FORMED = "rendezvous", "formed"
PROBE_S = 5.0  # a scheduler that does not answer /get_server_info in this long is blocked
KNOCK_S = 10.0  # one bind of the port, waiting for a blocked client to dial in
HOLD_S = 120.0  # all binds: SGLang's client waits up to ~90 s between tries (a jittered minute)
LEDGER_S = 5.0  # a write of the record to Redis


@dataclass(frozen=True)
class GroupRecord:
    """One update group as rank 0 wrote it down (module docstring)."""

    address: str
    port: int
    name: str
    world_size: int
    engines: list[str] = field(default_factory=list)
    phase: str = RENDEZVOUS

    def formed(self) -> GroupRecord:
        return replace(self, phase=FORMED)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> GroupRecord:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class GroupLedger:
    """The run's current update group, in Redis (a JSON string at `key`). A write that fails or
    takes over LEDGER_S (Redis away) is logged, never a failed or stalled sync: only the
    release after a crash is lost."""

    def __init__(self, redis: Any, key: str):
        self.redis, self.key = redis, key

    async def note(self, record: GroupRecord | None) -> None:
        try:
            if record is None:
                await aio.wait_for(self.redis.delete(self.key), LEDGER_S)
            else:
                await aio.wait_for(self.redis.set(self.key, record.to_json()), LEDGER_S)
        except Exception as err:
            log.warning("could not record the update group in %s: %r", self.key, err)

    async def read(self) -> GroupRecord | None:
        try:
            text = await aio.wait_for(self.redis.get(self.key), LEDGER_S)
            return None if text is None else GroupRecord.from_json(text)
        except Exception as err:  # unreadable: nothing to release
            log.warning("could not read the update group in %s: %s", self.key, err)
            return None


def knock(address: str, port: int, wait_s: float) -> bool:
    """Host a TCPStore at address:port for up to `wait_s`; True once a client dialed in and
    wrote its first key (torch's worker count), at which the store closes: that client's next
    store call fails. OSError-like errors (the port taken, an address not of this machine)
    propagate."""
    import torch

    store = torch.distributed.TCPStore(
        address, port, is_master=True, timeout=timedelta(seconds=wait_s + 5),
        wait_for_workers=False,
    )  # fmt: skip
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            if store.num_keys() > 0:
                return True
            time.sleep(0.05)
        return False
    finally:
        del store  # the last reference: the server stops and its connections close


async def blocked(http: httpx.AsyncClient, urls: list[str], probe_s: float = PROBE_S) -> list[str]:
    """The engines among `urls` that take a connection and do not answer /get_server_info
    within `probe_s` (a scheduler blocked); one that refuses the connection is down, not blocked."""

    async def hangs(url: str) -> bool:
        try:
            await aio.wait_for(http.get(url + "/get_server_info"), probe_s)
        except TimeoutError:
            return True
        except httpx.HTTPError:
            return False
        return False

    found = await asyncio.gather(*(hangs(u) for u in urls))
    return [u for u, hung in zip(urls, found, strict=True) if hung]


async def release(
    http: httpx.AsyncClient, record: GroupRecord, hold_s: float = HOLD_S
) -> tuple[list[str], list[str], str]:
    """Free the recorded engines blocked in `record`'s rendezvous (module docstring):
    (those freed, those still blocked, what stopped it: "" when nothing did)."""
    stuck = await blocked(http, record.engines) if record.phase == RENDEZVOUS else []
    freed: list[str] = []
    start = time.monotonic()
    while stuck and (left := hold_s - (time.monotonic() - start)) > 0:
        try:
            caught = await asyncio.to_thread(knock, record.address, record.port, min(KNOCK_S, left))
        except Exception as err:  # torch raises DistNetworkError/RuntimeError on a bind
            return freed, stuck, f"cannot bind {record.address}:{record.port} ({err})"
        # Freed or not, a scheduler that answers now is not ours to wait for.
        still = await blocked(http, stuck)
        if caught:
            log.info("update group %r: a blocked client dialed in; store closed", record.name)
        freed += [u for u in stuck if u not in still]
        stuck = still
    return freed, stuck, f"not freed within {hold_s:g} s" if stuck else ""
