"""The trainer's iteration: admit → collect → advantages → train → sync → eval → log → checkpoint.

It owns the policy version V (weight syncs done) and keeps the run's one invariant: every
admitted group ends in exactly one terminal state (trained, filtered, failed, dropped), so
at the end `admitted == trained + filtered + failed + dropped`. Admission runs as a pump
beside the loop, woken whenever a group ends or V moves; sync mode and async mode differ only
in its budget (--max-staleness). Training runs in a thread so the buffer keeps reading and,
in async mode, the rollout keeps going while the optimizer steps. Beside the loop, the
engine keeper (weights/keeper.py) looks after the engines between syncs; with none left,
admission pauses until one joins and is synced, up to --stall-timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

from millstream.common import aio, heap, telemetry, threads
from millstream.common.config import RunConfig

from .admission import Admission
from .batch import build_samples
from .buffer import Buffer
from .checkpoints import checkpoint
from .evaluate import Evaluator, accuracies, format_accuracies
from .observe.metrics import MetricsLogger, format_row
from .observe.watch import Watch
from .weights.keeper import EngineKeeper

T = TypeVar("T")

log = logging.getLogger(__name__)


def _behind(held: str | None, version: int) -> bool:
    """Whether an engine that reports weight version `held` needs this trainer's `version`
    at its start. At version 0 only an engine that holds a later numbered version (another
    run's weights) does: a fresh engine says 0, its launcher's label or SGLang's "default"."""
    if held == str(version):
        return False
    if version == 0:
        return held is not None and held.isdigit() and int(held) > 0
    return True


def _tracer() -> trace.Tracer:
    return telemetry.tracer("millstream.trainer")


@dataclass
class Parts:
    """What the loop calls; built by `main.build` (real services) or by a test."""

    backend: Any
    admission: Admission
    buffer: Buffer
    weight_sync: Any  # .sync(named_tensors, version) -> report with .removed
    evaluator: Evaluator | None
    logger: MetricsLogger
    coordinator: Any | None = None  # .publish_version(v)
    teacher: Any | None = None  # .score(samples) -> samples with teacher logprobs (OPD)
    watch: Watch | None = None  # progress and stall detection of long waits
    janitor: Callable[[], Awaitable[None]] | None = None  # trims streams while the run goes
    colocation: Any | None = None  # --colocate: turns on one GPU (weights/colocate.py)
    engine_book: Any | None = None  # the run's engines in Redis (weights/keeper.py EngineBook)
    lease: Any | None = None  # the run's lease (lease.py): checked before a step and a sync


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        parts: Parts,
        num_rollout: int,
        *,
        iteration: int = 0,
        version: int = 0,
    ):
        self.cfg = cfg
        self.p = parts
        self.num_rollout = num_rollout
        self.iteration = iteration
        self.version = version
        # The version admission budgets for: ahead of `version` while an idle weight sync
        # ships it (`_admit_ahead`), equal otherwise.
        self._admit_version = version
        self.completions = 0
        self._wake = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        # (iteration, seconds since start, accuracy per eval set)
        self.eval_history: list[tuple[int, float, dict[str, float]]] = []
        self._start = time.monotonic()
        coordinator = parts.coordinator
        self.keeper = EngineKeeper(
            parts.weight_sync,
            coordinator.take_pending_joins if coordinator is not None else tuple,
            stall_timeout_s=cfg.service.stall_timeout,
            coordinator_address=getattr(coordinator, "address", None),
            book=parts.engine_book,
        )
        # Held while the weights move (train, sync): the keeper's catch-up syncs go between.
        self._weights_lock = asyncio.Lock()
        # Set by the build: every engine gets this trainer's weights before the first rollout
        # (a resume, a torch_dist start), then the groups in flight at the checkpoint go out
        # again (a resume).
        self.sync_at_start = False
        self.readmit_at_start = False

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        heap.freeze_startup_heap()  # the model, the optimizer, every import: built by now
        await self._first_engines()
        # How the weights will reach each engine, said before anything trains (the engines
        # that join later get their line at their first sync).
        await self.p.weight_sync.routes(self.p.backend.device)
        if self.p.colocation is not None:
            await self.p.colocation.start()
        self._pump = asyncio.create_task(self._admission_pump(), name="admission")
        self.p.buffer.watch_feeder(self._pump)
        janitor = asyncio.create_task(self.p.janitor(), name="janitor") if self.p.janitor else None
        keeper = None
        if self.p.colocation is None:  # colocated engines are the launcher's: it keeps them
            looks = self.keeper.run(
                self.p.backend.named_weights, lambda: self.version, self._weights_lock
            )
            keeper = asyncio.create_task(looks, name="engine-keeper")
            self.p.buffer.watch_feeder(keeper)  # its give-up ends a wait for a batch
        try:
            if (
                self.p.evaluator
                and self.iteration == 0
                and not self.cfg.eval.skip_eval_before_train
            ):
                await self.evaluate()
            while self.iteration < self.num_rollout:
                await self.step()
        finally:
            # Bounded: a background task that does not end at its cancel is named and left
            # behind (common/aio.py), so a run whose last iteration is done always ends.
            await aio.stop_tasks((self._pump, janitor, keeper), who="trainer")
        await self.drain()

    async def drain(self, timeout_s: float = 120.0) -> None:
        """Wait for the groups still in flight, so every admitted group ends in one state."""
        a, deadline = self.p.admission, time.monotonic() + timeout_s
        while len(a.in_flight) > self.p.buffer.ready and time.monotonic() < deadline:
            self.p.buffer.check()
            await asyncio.sleep(0.2)
        self.p.buffer.drop_leftovers()
        if a.in_flight:
            log.error(
                "%d admitted groups never came back: %s", len(a.in_flight), sorted(a.in_flight)[:10]
            )

    async def step(self) -> None:
        """One iteration, traced as its own root span (stage `iteration`)."""
        it = self.iteration + 1
        attributes = {
            telemetry.STAGE: "iteration",
            "millstream.iteration": it,
            "millstream.version": self.version,
        }
        with _tracer().start_as_current_span(
            "trainer.iteration", context=otel_context.Context(), attributes=attributes
        ):
            await self._step(it)

    async def _step(self, it: int) -> None:
        tracer = _tracer()
        t0 = time.monotonic()
        n = self.cfg.rollout.rollout_batch_size
        with tracer.start_as_current_span(
            "trainer.batch_wait", attributes={telemetry.STAGE: "batch_wait"}
        ):
            groups = await self._watched(
                f"a batch of {n} groups (iteration {it})",
                self.p.buffer.take(n, self.version, self.cfg.service.max_weight_staleness),
                lambda: f"{self.p.buffer.ready} ready, {len(self.p.admission.in_flight)} in flight",
                abandon=True,  # where a stop ends the loop (Watch.request_stop)
            )
        t1 = time.monotonic()
        samples, stats = build_samples(groups, self.version, self.cfg)
        # The step and the sync that ships it link to each group's trace (its buffer wait).
        links = [trace.Link(c) for c in self.p.buffer.trace_taken(groups)]
        async with self._weights_lock:  # the keeper's catch-up syncs go between steps
            train, t2, report = await self._train_and_sync(it, samples, links, len(groups))
        t3 = time.monotonic()
        self.iteration = it
        self.completions += len(samples)
        metrics = {**stats, **train, **self._timings(t0, t1, t2, t3), **self._counts()}
        metrics["engines_removed"] = len(report.removed)
        if self.p.colocation is not None:
            metrics["colocate_time"] = self.p.colocation.seconds
        metrics["group_ids"] = [g.group.prompt.group_id for g in groups]
        if (
            self.p.evaluator
            and self.cfg.eval.eval_interval
            and it % self.cfg.eval.eval_interval == 0
        ):
            metrics |= await self.evaluate()
        self.p.logger.log(it, metrics, format_row(it, self.num_rollout, metrics), groups=groups)
        if self._should_save(it):
            self.save()

    async def _train_and_sync(
        self, it: int, samples: list[Any], links: list[trace.Link], n_groups: int
    ) -> tuple[dict[str, Any], float, Any]:
        """Train on `samples`, ship the weights as V+1 and publish it: (train metrics, when
        training ended, the sync's report)."""
        tracer = _tracer()
        attributes = {telemetry.STAGE: "train_step", "millstream.groups": n_groups}
        with tracer.start_as_current_span(
            "trainer.step", links=links, attributes=attributes
        ) as step_span:
            if self.p.teacher is not None:
                samples = await self.p.teacher.score(samples)
            if self.p.lease is not None:  # never train on a run another trainer holds
                await self.p.lease.ready()
            steps = self.cfg.rollout.num_steps_per_rollout
            if self.p.colocation is not None:
                await self.p.colocation.before_train()
            train = await threads.compute(
                self.p.backend.train_rollout, samples, steps, self.iteration
            )
            if self.p.colocation is not None:
                await self.p.colocation.before_sync()
        telemetry.mirror(tracer, step_span, links)  # the step in each group's own trace
        t2 = time.monotonic()
        weights = self.p.backend.named_weights
        if self.p.lease is not None:  # the step may have outlasted the lease
            await self.p.lease.ready()
        if self.p.colocation is not None:  # read where the turns say the weights are
            weights = self.p.colocation.sync_source(weights)
        report = await self._watched(
            f"the weight sync to version {self.version + 1}",
            self.keeper.sync(  # with the pending joins; waits when no engine is left
                weights,
                self.version + 1,
                links=links,
                idle=self._nothing_generating(),
                # Sync mode only (async rollouts run ahead of the sync already), and not after
                # the last iteration: nothing would train that batch.
                on_gated=(
                    self._admit_ahead
                    if self.cfg.max_staleness == 0 and it < self.num_rollout
                    else None
                ),
            ),
            stall=False,  # bounded by --weight-sync-timeout and --stall-timeout
        )
        if self.p.colocation is not None:
            await self.p.colocation.after_sync()
        self._publish_version(self.version + 1)
        return train, t2, report

    # -- pieces --------------------------------------------------------------------------------

    async def _first_engines(self) -> None:
        """Before the first rollout, the engines hold this trainer's weights. With none listed
        (a trainer that starts, or resumes, before its engines: a restart, a redeploy) it
        waits for one up to --stall-timeout, as a running trainer does (keeper.py), and says
        so. The current weights go to the engines that ask to join, to every engine when they
        must (`sync_at_start`: a resume, a torch_dist start) and to every engine that holds
        another version than this trainer's (one left by an earlier run: a re-run would
        sample from its weights)."""
        coordinator = self.p.coordinator
        ws = self.p.weight_sync
        await self.keeper.recall()  # engines of earlier starts: taken back if they answer
        listed = await ws.routed_engines(patient=True)
        held = await ws.versions(listed) if listed else {}
        behind = {u: v for u, v in held.items() if _behind(v, self.version)}
        if behind and not self.sync_at_start:
            print(
                f"[trainer] engine(s) hold weights of another version than this trainer's "
                f"{self.version} ({behind}): syncing them before any rollout",
                flush=True,
            )
        if not listed or behind or self.sync_at_start:
            await self.keeper.sync(self.p.backend.named_weights, self.version)
        elif coordinator is not None and (pending := coordinator.take_pending_joins()):
            await ws.sync(self.p.backend.named_weights, self.version, join=pending)
        if self.readmit_at_start:
            n = await self.p.admission.readmit(self.version)
            print(
                f"[trainer] resumed at iteration {self.iteration} (version {self.version}); "
                f"re-admitted {n} groups in flight",
                flush=True,
            )

    async def _watched(
        self,
        what: str,
        awaitable: Awaitable[T],
        detail: Callable[[], str] = str,
        stall: bool = True,
        abandon: bool = False,
    ) -> T:
        if self.p.watch is None:
            return await awaitable
        return await self.p.watch.wait(what, awaitable, detail, stall=stall, abandon=abandon)

    def _nothing_generating(self) -> bool:
        """Every admitted group is back in the buffer: no generation of ours runs, and none
        starts before the version moves. The pump admits only when V moves or a group ends,
        and with none in flight no group can end before the sync publishes the new V (a
        sync-mode sync between rollouts; in async mode once the next batch is generated)."""
        return len(self.p.admission.in_flight) == self.p.buffer.ready

    async def _admission_pump(self) -> None:
        """Admit whenever the budget has room: at start, when a group ends, when V moves.
        Never past the budget of version num_rollout - 1 - s, which holds every batch the
        run trains: more would be generated only to be dropped when it ends. With no engine
        left (the keeper waits for one), nothing: each group would fail."""
        last = max(0, self.num_rollout - 1 - self.cfg.max_staleness)
        while True:
            await self.keeper.ready.wait()
            await self.p.admission.fill(min(self._admit_version, last))
            await self._wake.wait()
            self._wake.clear()

    def _admit_ahead(self) -> None:
        """The router now routes only to engines that hold version V+1, and none does yet: an
        idle sync of V+1 has started. The next rollouts can be handed out now; they wait at
        the router for the engines to hold V+1 instead of for the sync to end, so their way
        through the workers overlaps the broadcast."""
        self._admit_version = self.version + 1
        self._wake.set()

    def on_terminal(self, gid: str, state: str) -> None:
        self.p.admission.terminal(gid, state)
        self._wake.set()

    def on_group_bytes(self, nbytes: int) -> None:
        """A training group came back weighing `nbytes` on the wire: --max-buffer-bytes counts
        it from now on (admission.py ByteBound), which may make room."""
        if self.p.admission.bytes is not None:
            self.p.admission.bytes.observe(nbytes)
            self._wake.set()

    def _publish_version(self, version: int) -> None:
        self.version = self._admit_version = version
        if self.p.coordinator is not None:
            self.p.coordinator.publish_version(version)
        self._wake.set()

    async def evaluate(self) -> dict[str, float]:
        assert self.p.evaluator is not None
        metrics = await self._watched(
            f"the eval at iteration {self.iteration}",
            self.p.evaluator.run(self.iteration, self.version),
        )
        data = getattr(self.p.evaluator, "last_data", {})
        metrics |= self.p.logger.log_eval(self.iteration, metrics, data) or {}  # --log-passrate
        acc = accuracies(list(self.p.evaluator.datasets), metrics)
        self.eval_history.append((self.iteration, time.monotonic() - self._start, acc))
        print(
            f"[trainer] eval at iter {self.iteration} (version {self.version}): "
            f"{format_accuracies(acc)}",
            flush=True,
        )
        return metrics

    @property
    def completions_per_s(self) -> float:
        return self.completions / max(1e-9, time.monotonic() - self._start)

    def _timings(self, t0: float, t1: float, t2: float, t3: float) -> dict[str, float]:
        return {
            "rollout_time": t1 - t0,
            "train_time": t2 - t1,
            "sync_time": t3 - t2,
            "total_time": t3 - t0,
            "completions_per_s": self.completions_per_s,
        }

    def _counts(self) -> dict[str, int]:
        c = self.p.admission.counts
        return {
            "admitted": c.admitted, "trained": c.trained, "filtered": c.filtered, "failed": c.failed,
            "dropped_stale": c.dropped_stale, "dropped_at_end": c.dropped_at_end, "in_flight": len(self.p.admission.in_flight),
            "duplicates": self.p.buffer.duplicates, "dead_letters": self.p.buffer.dead_letters,
            "version": self.version,
        }  # fmt: skip

    def _should_save(self, it: int) -> bool:
        c = self.cfg.ckpt
        if not c.save:
            return False
        return it == self.num_rollout or bool(c.save_interval and it % c.save_interval == 0)

    def save(self) -> Path:
        a = self.p.admission
        state = {
            "version": self.version,
            "data": a.source.state_dict(self.iteration - 1),  # Miles' rollout id: 0-based
            "counts": vars(a.counts),
            "in_flight": {gid: list(pos) for gid, pos in a.in_flight.items()},
            "run_instance": a.run_instance,
        }
        path = checkpoint.save(
            self.cfg.ckpt.save,
            self.iteration,
            self.p.backend,
            state,
            not self.cfg.ckpt.no_save_optim,
            # Renamed into place only while this trainer holds the run (lease.py).
            before_commit=None if self.p.lease is None else self.p.lease.check,
        )
        print(f"[trainer] saved checkpoint {path}", flush=True)
        return path
