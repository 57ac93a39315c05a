"""`millstream train` (strictly on-policy) and `millstream train-async` (--max-staleness >= 1).

Thin entry: parse flags and check them, the files and the packages they name (preflight.py:
exit 2 on a bad one, before anything starts), start what is missing (a private Redis,
engines, router and workers, unless --redis-url/--router-url say where they are),
publish the resolved config, build the trainer's parts (resuming from --load when it holds a
checkpoint), train, and stop everything in `finally`; then write RUN_DIR/summary.json, on
every way out (observe/summary.py): finished, an error, a stall, a signal.

SIGTERM and SIGINT stop the run cleanly: while the trainer's loop runs, the first one ends it
between iterations (the iteration under way finishes, observe/watch.py Watch.request_stop) and,
with --save, checkpoints that last iteration; before the loop, or at a second signal, the run
is cancelled at once. Either way the services stop in order and the CLI exits 130.

Under torchrun (WORLD_SIZE > 1) rank 0 does all of the above and ranks > 0 only train
(distributed.DataParallel): they build the backend alone and follow rank 0 until it says
STOP, which rank 0 does in `finally` (on error, torchrun ends the other ranks).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from millstream.common import aio, debug, heap, threads
from millstream.common.config import ConfigError, RunConfig, parse_run_config
from millstream.common.config import store as config_store
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect, eviction_warning, redact
from millstream.common.telemetry import setup_tracing, shutdown_tracing

from .lease import Lease

if TYPE_CHECKING:  # the heavy modules load only when a run starts
    from redis.asyncio import Redis

    from millstream.launch.cluster import LocalCluster

    from .build import Prepared
    from .observe.summary import RunEnd
    from .trainer import Trainer

log = logging.getLogger("millstream.trainer")


def _run(argv: Sequence[str], mode: str, prog: str) -> int:
    cfg = parse_run_config(argv, mode=mode, prog=prog)
    if cfg.rollout.fully_async and mode == "sync":  # Miles' flag for what train-async is
        print("[trainer] --fully-async: running as millstream train-async", flush=True)
        return _run(argv, "async", "millstream train-async")
    from . import preflight  # after parsing: `--help` stays quick
    from .checkpoints import atomic
    from .observe.finished import finished_line

    if (line := finished_line(cfg)) is not None:  # not trained again unless asked
        if os.environ.get("RANK", "0") == "0":  # torchrun: each rank exits 0, one says why
            print(line, flush=True)
        return 0
    # What a save killed mid-write left: put back or removed before preflight reads --load.
    for root in dict.fromkeys(r for r in (cfg.ckpt.save, cfg.ckpt.load) if r):
        for said in atomic.recover(root):
            print(f"[trainer] checkpoints: {said}", flush=True)
    try:
        preflight.check(cfg)  # everything that needs no service, before anything starts
    except ConfigError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=cfg.connection.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _apply_cpu_budget(cfg)
    heap.keep_freed_memory()  # train steps reuse their memory (common/heap.py)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_data_parallel(cfg)
    ranks = cfg.megatron.actor_num_nodes * cfg.megatron.actor_num_gpus_per_node
    if ranks > 1:
        command = prog.replace("millstream ", "", 1)
        print(
            f"{prog}: error: --actor-num-nodes x --actor-num-gpus-per-node = {ranks} trainer "
            "ranks: start them with torchrun, e.g.\n  torchrun --nnodes "
            f"{cfg.megatron.actor_num_nodes} --nproc-per-node "
            f"{cfg.megatron.actor_num_gpus_per_node} -m millstream.cli {command} " + _shown(argv),
            file=sys.stderr,
        )
        return 2
    return _run_trainer(cfg)


SECRET_FLAGS = ("--wandb-key", "--admin-token", "--redis-password")


def _shown(argv: Sequence[str]) -> str:
    """The command line with secrets masked (the values of SECRET_FLAGS, a password in a
    Redis URL), for messages that echo it."""
    out: list[str] = []
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if out and out[-1] in SECRET_FLAGS:
            out.append("***")
        elif eq and flag in SECRET_FLAGS:
            out.append(f"{flag}=***")
        else:
            out.append(redact(arg) if "://" in arg else arg)
    return " ".join(out)


def _apply_cpu_budget(cfg: RunConfig) -> None:
    """The trainer's share of the cores (launch/plan.py cpu_budget), split among local ranks."""
    from millstream.launch.plan import cpu_budget

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = max(1, cpu_budget(cfg).trainer // local_ranks)
    # Through the environment: torch, imported later (while the engines load, not before
    # they start: its import is seconds of CPU), sizes its pool from it.
    os.environ.update(threads.pool_env(n))
    if "torch" in sys.modules:
        n = threads.apply(n)
    print(f"[trainer] {n} compute thread(s)", flush=True)


class _Stop:
    """The first SIGTERM or SIGINT, and how the run under way is asked to end between
    iterations (`graceful`, set by train_loop while its trainer runs: False when it cannot)."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.graceful: Callable[[], bool] | None = None

    def interrupt(self, signum: int, _frame: object = None) -> None:
        """SIGTERM outside the event loop: as Ctrl-C (KeyboardInterrupt), its name kept."""
        self.signal = self.signal or signal.Signals(signum).name
        raise KeyboardInterrupt


def _run_trainer(cfg: RunConfig) -> int:
    from .observe.summary import RunEnd, ended_by

    stop, end = _Stop(), RunEnd(cfg.run_dir, cfg.ckpt.save)
    # SIGTERM (docker stop, kill, a job scheduler) stops the run like Ctrl-C: the `finally`
    # blocks stop every local service in order, instead of each dying of its death signal.
    signal.signal(signal.SIGTERM, stop.interrupt)
    provider = setup_tracing("trainer", cfg.run_dir)
    try:
        # Bounded at the end (common/aio.py): tasks that outlive their cancel are left behind.
        code, left = aio.run(_until_signal(train_with_cluster(cfg, stop, end), stop), who="trainer")
    except BaseException as err:
        end.write(*ended_by(err, stop.signal))
        raise
    finally:
        shutdown_tracing(provider)
    end.write(*ended_by(None, stop.signal if code is None else None))
    if left:  # whatever they hold (a thread of theirs, a socket) must not keep the process
        print(f"[trainer] exiting with task(s) {left} left behind (logged above)", flush=True)
        _exit_now(130 if code is None else code)
    if code is None:
        raise KeyboardInterrupt  # stopped by a signal: the CLI says "interrupted", exits 130
    return code


def _exit_now(code: int) -> NoReturn:
    """End the process at once, our own files written: no interpreter finalization (it joins
    threads that may be stuck with the tasks left behind)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _until_signal(run: Coroutine[Any, Any, int], stop: _Stop) -> int | None:
    """`run`, or None once SIGTERM or SIGINT ended it. The first signal asks the run to end
    between iterations (`stop.graceful`); before the trainer's loop runs, or at a second
    signal, the run's task is cancelled, so its `finally` blocks (the local services stopped
    in order) run before anything else is cancelled. A KeyboardInterrupt raised by the signal
    itself would land in whichever task runs at that moment: one landing in a background task
    while asyncio cancelled the rest at exit skipped those blocks (tests/e2e/test_train.py,
    ~1 in 10)."""
    from .observe.watch import Stopped

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_signal(sig: signal.Signals) -> None:
        first = stop.signal is None
        stop.signal = stop.signal or sig.name
        if first and stop.graceful is not None and stop.graceful():
            print(
                f"[trainer] {sig.name}: stopping after the iteration under way (a checkpoint "
                "first with --save); a second signal stops at once",
                flush=True,
            )
            return
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await run
    except (asyncio.CancelledError, Stopped):
        if stop.signal is not None:
            return None
        raise
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        signal.signal(signal.SIGTERM, stop.interrupt)


def _run_data_parallel(cfg: RunConfig) -> NoReturn:
    from .backends import distributed

    rank = distributed.init()
    try:
        if rank > 0:
            from .build import build_follower

            build_follower(cfg).follow()
            code = 0
        else:
            try:
                code = _run_trainer(cfg)
            finally:
                distributed.send_stop()
    finally:
        distributed.shutdown()
    _exit_without_finalizing(code)


def _exit_without_finalizing(code: int) -> NoReturn:
    """End a torchrun rank that finished cleanly without the interpreter's finalization.
    Everything of ours is closed by now (services, tracing, trackers, the process group), but
    gloo's C++ worker threads may still let go of tensors and take the GIL while the
    interpreter is torn down, and a thread that takes the GIL then is ended in a way that
    aborts the process ("terminate called without an active exception", SIGABRT: rank 1 of
    tests/e2e/test_train_ddp.py, once in ~50 CI runs; pytorch/pytorch#179291 describes it).
    An error still propagates, for torchrun to report. multiprocessing's children are ended
    here, as finalization would have: megatron's torch_dist save (megatron/dist.py) keeps a
    Manager process, which would outlive the rank and hold torchrun's stdout open."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    _exit_now(code)


def train(argv: Sequence[str]) -> int:
    return _run(argv, "sync", "millstream train")


def train_async(argv: Sequence[str]) -> int:
    return _run(argv, "async", "millstream train-async")


async def train_with_cluster(
    cfg: RunConfig, stop: _Stop | None = None, end: RunEnd | None = None
) -> int:
    from millstream.launch.cluster import LocalCluster, run_all

    cluster = LocalCluster(cfg)
    try:
        urls = await cluster.spawn_infra()
        cfg = urls.apply(cfg)
        # The trainer's imports and model build run while the engines load (both are
        # seconds of CPU): on the compute thread that will train the model (threads.compute),
        # so this loop keeps watching the services start.
        preparing = asyncio.create_task(threads.compute(_prepare, cfg))
        try:
            # A given --redis-url is another service's Redis, which may come up after this
            # process (docker stack deploy orders nothing): wait for it as for an outage.
            redis = await connect(
                cfg.connection.redis_url,  # type: ignore[arg-type]
                cfg.connection.redis_password,
                wait_s=cfg.service.redis_outage_timeout,
                outage_timeout_s=cfg.service.redis_outage_timeout,
                who="trainer",
            )
            if warning := await eviction_warning(redis):
                print(f"[trainer] WARNING: {warning}", flush=True)
            try:
                # One trainer per run (lease.py): before anything of the run is written.
                lease = Lease(
                    redis, RunKeys(cfg.run_id), cfg.service.lease_ttl, held=cfg.service.lease_held
                )
                await lease.acquire()
                keeping = asyncio.create_task(lease.keep(), name="lease")
                try:
                    await config_store.publish(redis, cfg)
                    config_store.write_file(cfg, cfg.run_dir)
                    await run_all([cluster.finish_start(), preparing])
                    return await train_loop(
                        cfg, redis, cluster, preparing.result(), stop, end, lease, keeping
                    )
                finally:
                    keeping.cancel()
                    await asyncio.gather(keeping, return_exceptions=True)
                    await lease.release()
            finally:
                await redis.aclose()
        finally:
            preparing.cancel()  # when something else failed first (the thread runs to its end)
            await asyncio.gather(preparing, return_exceptions=True)
    finally:
        cluster.stop()


def _prepare(cfg: RunConfig) -> Prepared:
    from .build import prepare  # torch and transformers: imported here, in the thread

    # torch sized its intra-op pool from the environment (_apply_cpu_budget); the rest of
    # the budget (one inter-op thread) only once it is imported.
    threads.apply(int(os.environ["OMP_NUM_THREADS"]))
    return prepare(cfg)


async def train_loop(
    cfg: RunConfig,
    redis: Redis,
    cluster: LocalCluster,
    prepared: Prepared | None = None,
    stop: _Stop | None = None,
    end: RunEnd | None = None,
    lease: Lease | None = None,
    keeping: asyncio.Task[None] | None = None,
) -> int:
    """Build the trainer and run it while the services live; `lease` (held, and renewed by
    the task `keeping`) fences its side effects, and losing it ends the run (exit 5)."""
    from .build import build_trainer, close_all
    from .observe.watch import Stopped

    debug.dump_tasks_on_sigusr2()  # `kill -USR2`: where each coroutine waits
    trainer, closers = await build_trainer(
        cfg, redis, cluster.budget, prepared, placements=cluster.engine_placements(), lease=lease
    )
    if end is not None:
        end.watch(trainer)
    if trainer.iteration:  # restored from --load (no checkpoint is of iteration 0)
        trainer.p.logger.mark_resume(trainer.iteration)
    run = asyncio.create_task(trainer.run(), name="trainer")
    watch = asyncio.create_task(cluster.watch(), name="watchdog")
    if stop is not None:
        stop.graceful = functools.partial(_stop_between_iterations, trainer)
    try:
        waits = {run, watch} | ({keeping} if keeping is not None else set())
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if keeping in done and not run.done():
            keeping.result()  # raises LeaseLost: another trainer holds the run now
        if watch in done and not run.done():
            watch.result()  # raises: which service died, with the tail of its log
        try:
            run.result()
        except Stopped:
            _save_on_stop(cfg, trainer)
            raise
    finally:
        if stop is not None:
            stop.graceful = None
        # Whatever ended first (the run, a service's death, SIGTERM or Ctrl-C cancelling
        # this task), the other stops before what they use is closed.
        # The run's own stop waits for its background tasks (up to STOP_GRACE_S) first.
        await aio.stop_tasks((run, watch), 3 * aio.STOP_GRACE_S, who="trainer")
        await close_all(closers)
        if end is not None:
            end.take()
    return 0


def _stop_between_iterations(trainer: Trainer) -> bool:
    """Ask the trainer's loop to end at its next batch wait (or the one under way); False
    when it is not in its loop yet (starting: nothing half-way, cancelling is clean)."""
    watch = trainer.p.watch
    if watch is None or not watch.looping:
        return False
    watch.request_stop()
    return True


def _save_on_stop(cfg: RunConfig, trainer: Trainer) -> None:
    """A stop between iterations with --save: the last finished iteration's checkpoint,
    unless that iteration has one already."""
    from .checkpoints import checkpoint

    save = cfg.ckpt.save
    if save and trainer.iteration and checkpoint.latest_iteration(save) != trainer.iteration:
        trainer.save()
