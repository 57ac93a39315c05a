"""The heap of a long-running service: the start-up objects kept out of the garbage
collector's way, and freed memory kept for reuse.

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

import ctypes
import ctypes.util
import gc


def freeze_startup_heap() -> None:
    """Exclude every object alive now from future collections (module docstring)."""
    gc.freeze()


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep memory a step frees for the next step instead of giving it
    back to the OS (and taking it again, page by page). A train step allocates and frees the
    same activations every time; by default blocks past glibc's mmap threshold are unmapped
    on free and the top of the heap trimmed, so every step faulted its memory in again: 2,300
    minor faults (9 MB) and 15-20% of a core in the kernel per step of the small peer
    benchmark's train step; ~30 with this when it runs alone, ~400 inside `millstream train`. Allocations under 256 MB come from the heap, and
    up to 1 GB of free memory at its top is kept. False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, 256 << 20),
            (_M_TRIM_THRESHOLD, 1 << 30),
            (_M_TOP_PAD, 64 << 20),
        )
    )
