"""Fencing numbers: the router and the engines refuse a trainer that no longer holds its run.

A trainer holds its run through a lease in Redis (trainer/lease.py); each new holder gets a
fencing number larger than every earlier holder's. It sends `X-Millstream-Fence: <run>/<n>` on
every admin call (weight updates, pause and continue, the router's version and membership
calls). A service remembers the largest number it has seen for each run and refuses a call
with a smaller one (409): an old holder that was partitioned away while a new one took the run
cannot change the weights or the routing behind the new one's back, however late its
requests arrive. A call without the header (an operator's curl, Miles' own scripts) is not
fenced: fencing orders trainers, it is not access control (the admin token is, common/auth.py).

The memory is the process's: a restarted service has seen nobody, and the first trainer to
call it sets the mark. A real SGLang server ignores the header; there the old holder's own
lease check (it stops pushing once its lease is no longer valid) is the fence.

Imports nothing heavy: the router, the engine and the trainer all load it.
"""

from __future__ import annotations

import threading

from .errors import MillstreamError

FENCE_HEADER = "X-Millstream-Fence"
FENCED = "fenced"  # the error type of a refusal (the JSON body's "type")


class FencedOut(MillstreamError):
    """A newer trainer holds the run: this one's call was refused (by a router, an engine, or
    a fenced stream script) and it must stop. The CLI exits 5."""

    exit_code = 5


def fence_value(run_id: str, fence: int) -> str:
    return f"{run_id}/{fence}"


def fence_headers(run_id: str, fence: int | None) -> dict[str, str]:
    """The header a lease holder's admin calls carry; none without a lease (tests, tools)."""
    return {} if fence is None else {FENCE_HEADER: fence_value(run_id, fence)}


class FenceGate:
    """The largest fencing number seen per run; `refusal` says why a call may not proceed."""

    def __init__(self) -> None:
        self._highest: dict[str, int] = {}
        self._lock = threading.Lock()

    def refusal(self, header: str | None) -> str | None:
        """None when the call may proceed (no header, or a number at least the largest seen
        for its run, which becomes the largest); otherwise the reason, naming both numbers."""
        if header is None:
            return None
        run_id, sep, number = header.rpartition("/")
        if not sep or not run_id or not number.isdigit():
            return f"malformed {FENCE_HEADER} {header!r}: expected <run id>/<number>"
        fence = int(number)
        with self._lock:
            highest = self._highest.get(run_id, 0)
            if fence < highest:
                return (
                    f"fenced: a newer trainer of run {run_id} holds it (fencing number "
                    f"{highest}); this call came from an older holder ({fence}), which lost "
                    "the lease"
                )
            self._highest[run_id] = fence
        return None

    def highest(self, run_id: str) -> int | None:
        return self._highest.get(run_id)
