"""The start-up heap, kept out of the garbage collector's way.

A service imports torch, transformers, FastAPI and the rest, and loads its model: hundreds of
thousands of Python objects that live until it exits. CPython's collector walks every one of
them in each full collection, and a service's steady state (train steps, decode steps, stream
entries) allocates enough to trigger one every second or so. In the trainer of the small peer
benchmark that was 3.8 ms of collections per 170 ms step (bench/bench_vs_peers.py).

`freeze_startup_heap()`, called once a service is ready, moves everything allocated so far into
the permanent generation (`gc.freeze`), which collections skip. Cycles made afterwards are
collected as before; garbage left over from start-up stays (a few MB at most).
"""

from __future__ import annotations

import gc
import os


def freeze_startup_heap() -> None:
    """Exclude every object alive now from future collections (module docstring)."""
    if os.environ.get("MILLSTREAM_NO_FREEZE"):
        return
    gc.freeze()
