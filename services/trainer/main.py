"""`millstream train` (strictly on-policy) and `millstream train-async` (--max-staleness >= 1).

Thin entry: parse flags and check them, the files and the packages they name (preflight.py:
exit 2 on a bad one, before anything starts), start what is missing (a private Redis,
engines, router and workers, unless --redis-url/--router-url say where they are),
publish the resolved config, build the trainer's parts (resuming from --load when it holds a
checkpoint), train, print the summary, and stop everything in `finally`.

Under torchrun (WORLD_SIZE > 1) rank 0 does all of the above and ranks > 0 only train
(distributed.DataParallel): they build the backend alone and follow rank 0 until it says
STOP, which rank 0 does in `finally` (on error, torchrun ends the other ranks).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from millstream.common import debug, heap, threads
from millstream.common.config import ConfigError, RunConfig, parse_run_config
from millstream.common.config import store as config_store
from millstream.common.redis_conn import connect, redact
from millstream.common.telemetry import setup_tracing, shutdown_tracing

from .evaluate import format_accuracies

if TYPE_CHECKING:  # the heavy modules load only when a run starts
    from redis.asyncio import Redis

    from millstream.launch.cluster import LocalCluster

    from .build import Prepared
    from .trainer import Trainer

log = logging.getLogger("millstream.trainer")


def _run(argv: Sequence[str], mode: str, prog: str) -> int:
    cfg = parse_run_config(argv, mode=mode, prog=prog)
    if cfg.rollout.fully_async and mode == "sync":  # Miles' flag for what train-async is
        print("[trainer] --fully-async: running as millstream train-async", flush=True)
        return _run(argv, "async", "millstream train-async")
    from . import preflight  # after parsing: `--help` stays quick

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


def _run_trainer(cfg: RunConfig) -> int:
    # SIGTERM (docker stop, kill, a job scheduler) stops the run like Ctrl-C: the `finally`
    # blocks stop every local service in order, instead of each dying of its death signal.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    provider = setup_tracing("trainer", cfg.run_dir)
    try:
        code = asyncio.run(_until_sigterm(train_with_cluster(cfg)))
    finally:
        shutdown_tracing(provider)
    if code is None:
        raise KeyboardInterrupt  # stopped by SIGTERM: the CLI says "interrupted"
    return code


async def _until_sigterm(run: Coroutine[Any, Any, int]) -> int | None:
    """`run`, or None once SIGTERM cancelled it. While the loop runs, SIGTERM cancels the
    run's task, so its `finally` blocks (the local services stopped in order) run before
    anything else is cancelled. A KeyboardInterrupt raised by the signal itself lands in
    whichever task runs at that moment: one landing in a background task while asyncio
    cancelled the rest at exit skipped those blocks (tests/e2e/test_train.py, ~1 in 10)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)
    try:
        return await run
    except asyncio.CancelledError:
        if stopped:
            return None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.default_int_handler)


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
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def train(argv: Sequence[str]) -> int:
    return _run(argv, "sync", "millstream train")


def train_async(argv: Sequence[str]) -> int:
    return _run(argv, "async", "millstream train-async")


async def train_with_cluster(cfg: RunConfig) -> int:
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
            redis = await connect(cfg.connection.redis_url, cfg.connection.redis_password)  # type: ignore[arg-type]
            try:
                await config_store.publish(redis, cfg)
                config_store.write_file(cfg, cfg.run_dir)
                await run_all([cluster.finish_start(), preparing])
                return await train_loop(cfg, redis, cluster, preparing.result())
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
    cfg: RunConfig, redis: Redis, cluster: LocalCluster, prepared: Prepared | None = None
) -> int:
    from .build import build_trainer, close_all

    debug.dump_tasks_on_sigusr2()  # `kill -USR2`: where each coroutine waits
    trainer, closers = await build_trainer(
        cfg, redis, cluster.budget, prepared, placements=cluster.engine_placements()
    )
    run = asyncio.create_task(trainer.run(), name="trainer")
    watch = asyncio.create_task(cluster.watch(), name="watchdog")
    try:
        done, _ = await asyncio.wait({run, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch in done and not run.done():
            watch.result()  # raises: which service died, with the tail of its log
        run.result()
    finally:
        # Whatever ended first (the run, a service's death, SIGTERM or Ctrl-C cancelling
        # this task), the other stops before what they use is closed.
        for task in (run, watch):
            task.cancel()
        await asyncio.gather(run, watch, return_exceptions=True)
        await close_all(closers)
    print_summary(trainer, Path(cfg.run_dir))
    return 0


def print_summary(t: Trainer, run_dir: Path) -> None:
    c = t.p.admission.counts
    counts = {
        k: getattr(c, k)
        for k in ("admitted", "trained", "filtered", "failed", "dropped_stale", "dropped_at_end")
    }
    counts["in_flight_lost"] = len(t.p.admission.in_flight)
    counts["duplicates_ignored"] = t.p.buffer.duplicates
    counts["dead_letters"] = t.p.buffer.dead_letters
    print(
        "[trainer] terminal states: " + " ".join(f"{k}={v}" for k, v in counts.items())
        + f" (admitted == trained + filtered + failed + dropped: {c.admitted == c.terminal})"
    )  # fmt: skip
    curve = [(it, round(secs, 1), acc) for it, secs, acc in t.eval_history]
    for it, secs, acc in curve:
        print(f"[trainer] eval curve: iter {it:>4} at {secs:>7.1f}s  {format_accuracies(acc)}")
    print(f"[trainer] completions/s: {t.completions_per_s:.1f}")
    summary = {"counts": counts, "eval_curve": curve, "completions_per_s": t.completions_per_s}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
