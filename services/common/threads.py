"""The CPU budget: how many compute threads each co-located service may use.

Why. torch's intra-op pool defaults to one thread per core. An engine and a trainer on the
same machine then each spin up a full pool; in async mode they compute at the same time and
every parallel region waits on threads the other process holds. On 2 cores that made a
0.08 s train step take 1.0 s. So the machine's cores are split, once, at start-up:

    budget = split_cores(cores=2, engines=1)   # trainer 1 thread, engine 1 thread
    budget = split_cores(cores=16, engines=2)  # trainer 8, each engine 4

Rule: the trainer gets half the cores (rounded up), the engines share the rest evenly, and
everyone gets at least one thread; with more engines than cores, engines share. In sync mode
(`overlap=False`) the trainer trains only while the engines wait for the next rollout, and
they generate only while it waits for that rollout, so each takes every core: the trainer
all of them, the engines all of them between them (on the medium peer benchmark, 2 engine
threads instead of 1: rollout 85 -> 66 ms, the sync step 375 -> 356 ms). The stream
workers, the router and Redis are single-threaded asyncio processes; they get one compute
thread each (`OMP_NUM_THREADS=1` and friends), so no native library they load (tokenizers,
math-verify's sympy, numpy) starts a pool of its own.

A service given `--num-threads N` uses N; 0 or nothing means "decide from the machine"
(the launcher passes its split to the services it starts). `apply(n)` sets torch's pools
once per process and returns what was set, for the start-up line.

One thread computes (`compute`). torch's OpenMP pool belongs to the thread that calls it, and
once a process's pools hold more threads than it has cores, libgomp cuts every pool's wait
between two parallel regions from a spin to ~100 spins (its "throttled" spin): each op then
wakes its workers from sleep. A second pool is easy to make by accident: `asyncio.to_thread`
may run the model build, the train step and the weight broadcast on three different threads
of the default executor. In the small peer benchmark's trainer (2 threads on 2 cores) one
stray pool made the train step 7-12% slower. So the trainer runs its torch work through
`compute`, on one thread that lives as long as the process.

That spin is bounded (`spin_env`): libgomp's default, 300,000 rounds, keeps a pool thread
spinning on a core for milliseconds after a train step ends, while the weight sync that
follows needs that core for the engine (the small benchmark's sync: 11.5 -> 14 ms). 10,000
rounds covers the gaps between the ops of a step, not the gaps between steps; 1,000 was too
few (train 55-58 ms -> 58-61 ms).

Cores idle in async mode are lent, not left idle (`BorrowedCores`): with a bounded staleness
the engines finish the next batch early in a long train step and then have nothing to
generate; for the rest of the step the trainer computes with every core, and goes back to
its share as soon as a group is in flight again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# Native thread pools a library may start on its own, capped for a service's process.
POOL_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class CpuBudget:
    cores: int
    trainer: int
    engine: int  # per engine
    engines: int

    def describe(self) -> str:
        return (
            f"CPU budget: {self.cores} core(s): trainer {self.trainer} thread(s), "
            f"{self.engines} engine(s) x {self.engine} thread(s), workers and router 1 each"
        )


def split_cores(
    cores: int, engines: int, trainer: int | None = None, *, overlap: bool = True
) -> CpuBudget:
    """Split `cores` between the trainer and `engines` engines (module docstring);
    `trainer` fixes the trainer's share (e.g. from its --num-threads); `overlap`: do
    training and generation run at the same time (async mode)?"""
    cores = max(1, cores)
    share = (cores + 1) // 2 if engines else cores  # the trainer's, when the two overlap
    if trainer is None or trainer <= 0:
        trainer = share if overlap else cores
    trainer = max(1, min(trainer, cores))
    # Engines get what an overlapping trainer leaves; in sync mode, every core.
    left = cores - trainer if overlap else cores
    engine = max(1, left // engines) if engines else 0
    return CpuBudget(cores=cores, trainer=trainer, engine=engine, engines=engines)


# How long an idle OpenMP pool thread spins before it sleeps (module docstring).
SPIN_COUNT = "10000"


def pool_env(threads: int) -> dict[str, str]:
    """Environment that caps native thread pools of a child process at `threads`."""
    env = {name: str(threads) for name in POOL_ENV_VARS} | {"TOKENIZERS_PARALLELISM": "false"}
    return env | spin_env()


def spin_env() -> dict[str, str]:
    """libgomp's spin before an idle pool thread sleeps, unless the environment chose one;
    read once, when torch loads libgomp."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


def apply(threads: int | None) -> int:
    """Set this process's torch intra-op threads to `threads` (None or 0: every core this
    process may use) and inter-op threads to 1; returns the intra-op count in force."""
    import torch

    n = threads if threads and threads > 0 else machine_cores()
    torch.set_num_threads(n)
    # Already set, or parallel work already ran: keep what is there.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return torch.get_num_threads()


_compute_thread: ThreadPoolExecutor | None = None


async def compute(fn: Callable[..., T], /, *args: Any) -> T:
    """`fn(*args)` on this process's one compute thread (module docstring), awaited from the
    event loop like `asyncio.to_thread`, context variables (the current span) included."""
    global _compute_thread
    if _compute_thread is None:
        _compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    call = functools.partial(contextvars.copy_context().run, fn, *args)
    return await asyncio.get_running_loop().run_in_executor(_compute_thread, call)


class BorrowedCores:
    """The trainer's use of the engines' cores while they are idle (module docstring).

    `retune()` sets the calling thread's torch pool to `most` threads while `idle()` holds,
    else to `own`: torch sizes its OpenMP pool per thread, so it must run in the thread that
    computes. `hook_layers(model)` calls it before every layer's forward and again at each
    layer in the backward (which runs in the same thread), fine enough to catch the engines
    going idle inside one step. `idle` is read from that thread
    while the event loop changes what it reads: a stale answer costs one layer at the
    wrong width, nothing else.
    """

    def __init__(self, own: int, most: int, idle: Callable[[], bool]):
        self.own = own
        self.most = most
        self.idle = idle
        self.switches = 0

    def retune(self) -> int:
        import torch

        want = self.most if self.idle() else self.own
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
            self.switches += 1
        return want

    def hook_layers(self, model: Any) -> list[Any]:
        """Call `retune` before the forward of each layer of `model` (the members of its
        longest ModuleList: the decoder layers of a transformer) and, in the backward,
        when the gradient of each layer's output is computed; returns the hook handles."""
        import torch

        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
        layers = max(lists, key=len) if lists else [model]
        handles = [layer.register_forward_pre_hook(self._before_layer) for layer in layers]
        handles += [layer.register_forward_hook(self._after_layer) for layer in layers]
        return handles

    def _before_layer(self, _module: Any, _args: Any) -> None:
        self.retune()

    def _after_layer(self, _module: Any, _args: Any, output: Any) -> None:
        # The backward runs in the same thread: retune there too, layer by layer.
        hidden = output[0] if isinstance(output, tuple | list) and output else output
        if getattr(hidden, "requires_grad", False):
            hidden.register_hook(self._in_backward)

    def _in_backward(self, _grad: Any) -> None:
        self.retune()
