"""The service heap settings (common/heap.py) do what they say, in this process."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from millstream.common import heap


def test_freeze_moves_every_live_object_out_of_the_collectors_reach():
    before = gc.get_freeze_count()
    alive = [object() for _ in range(1000)]  # noqa: F841 - kept alive across the freeze
    try:
        heap.freeze_startup_heap()
        assert gc.get_freeze_count() >= before + 1000
        assert gc.get_count()[2] == 0  # nothing left in the oldest generation to walk
    finally:
        gc.unfreeze()


ONE_ROUND = """
import ctypes, resource
from millstream.common import heap

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
SIZE = 16 << 20

def faults_of_one_round():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(SIZE)
    libc.memset(block, 1, SIZE)  # touch every page
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

faults_of_one_round()
default = faults_of_one_round()
kept = heap.keep_freed_memory()
faults_of_one_round()  # the first round after it maps the block into the heap
print(default, kept, faults_of_one_round())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_memory_freed_and_allocated_again_is_not_faulted_in_again():
    """A 16 MB block freed and allocated again (what every train step does with its
    activations): with glibc's defaults it is unmapped on free and faulted in page by page
    each time; kept, the next rounds fault (almost) nothing in. In a process of its own:
    the setting stays for the life of the process."""
    out = subprocess.run(
        [sys.executable, "-c", ONE_ROUND], capture_output=True, text=True, check=True
    ).stdout.split()
    pages = (16 << 20) // 4096
    default, kept, after = int(out[0]), out[1] == "True", int(out[2])
    assert default > pages // 2 and kept and after < pages // 20, out
