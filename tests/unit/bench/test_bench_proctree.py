"""The peer bench's CPU accounting and machine description (bench/proctree.py): a real
process tree, real /proc."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from proctree import (
    MACHINE,
    STEAL,
    CpuSampler,
    children,
    cpu_list,
    cpu_seconds,
    machine,
    machine_seconds,
    role_of,
)

# A parent that starts a child which spins for BURN_S of CPU, then both sleep: the sampler must
# find the grandchild and charge its CPU to the tree.
BURN_S = 0.6
TREE = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import time
end = time.process_time() + {BURN_S}
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(30)
'''])
time.sleep(30)
"""


@pytest.fixture
def tree():
    proc = subprocess.Popen([sys.executable, "-c", TREE])
    yield proc
    for pid in children(proc.pid):
        subprocess.run(["kill", str(pid)], check=False)
    proc.kill()
    proc.wait()


def test_sampler_charges_a_grandchilds_cpu_to_the_tree(tree):
    sampler = CpuSampler(tree.pid, every_s=0.05).start()
    start = time.time()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the grandchild has burnt its CPU
        grandchild = children(tree.pid)
        if grandchild and (cpu_seconds(grandchild[0]) or 0.0) >= BURN_S - 0.02:
            break
        time.sleep(0.05)
    time.sleep(0.3)  # a few samples after the burn
    idle_from = time.time()
    time.sleep(0.5)
    sampler.stop()
    assert len(children(tree.pid)) == 1
    used = sampler.between(start, idle_from)
    ours = sum(v for role, v in used.items() if role not in (MACHINE, STEAL))
    assert BURN_S * 0.9 <= ours <= BURN_S + 1.0  # the spin, plus two interpreters' start
    assert used[MACHINE] >= ours * 0.9  # the whole machine did at least what the tree did
    idle = sampler.between(idle_from + 0.1, time.time() - 0.1)
    assert sum(v for role, v in idle.items() if role not in (MACHINE, STEAL)) < 0.05


def test_at_interpolates_between_samples_and_clamps_outside():
    sampler = CpuSampler(1)
    sampler.times = [10.0, 20.0]
    sampler.samples = [{"engine": 1.0}, {"engine": 3.0, "router": 1.0}]
    assert sampler.at(15.0) == {"engine": 2.0, "router": 0.5}
    assert sampler.at(5.0) == {"engine": 1.0}
    assert sampler.at(25.0) == {"engine": 3.0, "router": 1.0}
    assert sampler.between(10.0, 20.0) == {"engine": 2.0, "router": 1.0}


def test_role_of_names_a_plain_executable(tree):
    deadline = time.monotonic() + 20
    while not children(tree.pid) and time.monotonic() < deadline:  # it has exec'd by then
        time.sleep(0.05)
    assert role_of(tree.pid).startswith("python")


def test_the_cpus_of_a_pinned_tree_add_up_to_the_whole_machine():
    cpus = sorted(os.sched_getaffinity(0))
    whole, each = machine_seconds(), [machine_seconds([c]) for c in cpus]
    if len(cpus) == (os.cpu_count() or 1):  # every CPU of the host: the first line's sum
        assert sum(e[MACHINE] for e in each) == pytest.approx(whole[MACHINE], abs=1.0)
    assert all(e[MACHINE] <= machine_seconds()[MACHINE] for e in each)
    assert machine_seconds([])[MACHINE] == 0.0


def test_machine_and_cpu_list_describe_the_host():
    m = machine()
    assert m["cpu_model"] and m["memory_gib"] > 0
    assert 1 <= m["cores_usable"] <= m["cores_total"]
    assert cpu_list([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert cpu_list([5]) == "5"
