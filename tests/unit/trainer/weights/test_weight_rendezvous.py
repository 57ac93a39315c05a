"""The release of a rendezvous left blocked by a dead rank 0 (trainer/weights/rendezvous.py),
without SGLang: a process joins an update group the way SGLang 0.5.23 does (torch's tcp://
rendezvous as rank 1 of 2, then gloo's wait for rank 0's keys) at a port nobody serves any
more, and dials it again and again. `knock` binds the port, and the joiner's rendezvous fails
at its next dial instead of after its timeout. The same against a real SGLang server:
tests/sglang_live/test_faults.py."""

from __future__ import annotations

import subprocess
import sys
import time

from millstream.trainer.weights.rendezvous import GroupRecord, knock
from tests.support.redis_server import free_port

# SGLang's init_custom_process_group, cut to what blocks: the store client, then a wait on it.
JOINER = """
import sys, time
from datetime import timedelta
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

start = time.monotonic()
store, _, _ = next(rendezvous(sys.argv[1], 1, 2, timeout=timedelta(seconds=600)))
try:
    PrefixStore("millstream_weights_x_1", store).wait(["0"])
except Exception as err:
    print(f"rendezvous failed after {time.monotonic() - start:.1f} s: {err}", flush=True)
"""


def test_a_joiner_dialing_a_dead_rank_0_is_freed_by_binding_its_port():
    port = free_port()  # rank 0 bound it, posted the init, and was killed
    joiner = subprocess.Popen(
        [sys.executable, "-c", JOINER, f"tcp://127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        time.sleep(3.0)  # it starts and dials (a refused connection, again and again)
        assert joiner.poll() is None, joiner.communicate()[0]
        assert knock("127.0.0.1", port, wait_s=60)  # it dialed in, and the store closed
        out, _ = joiner.communicate(timeout=60)  # without the knock: 600 s
    finally:
        if joiner.poll() is None:
            joiner.kill()
        joiner.communicate()
    (failed,) = [line for line in out.splitlines() if "rendezvous failed after" in line]
    print(failed)


def test_nobody_dialing_the_port_the_knock_gives_up_after_its_wait():
    start = time.monotonic()
    assert not knock("127.0.0.1", free_port(), wait_s=0.5)
    assert time.monotonic() - start < 30  # bounded: it does not wait on anyone


def test_a_group_record_reads_back_as_written():
    record = GroupRecord("10.0.0.7", 41234, "millstream_weights_ab12cd_3", 3, ["http://e:1"])
    assert GroupRecord.from_json(record.to_json()) == record
    assert GroupRecord.from_json(record.formed().to_json()).phase == "formed"
