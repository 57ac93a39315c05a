"""The train step under torch.profiler: Miles' TrainProfiler (miles/utils/profile_utils.py),
driven by the same flags (common/config/profiling.py), for the torch backend.

The backend takes `profiler.target(name, rollout_id)` around three regions of a rollout:

    train_overall     the whole `train_rollout`
    train_log_probs   the no-grad forwards before the update (old policy, reference, critic,
                      teacher) and the advantages: `prepare`
    train_actor       the optimizer steps: forward, backward and step per micro-batch

Each region is a `torch.profiler.record_function` range named `millstream.<target>`, so the
train step is findable in any trace. For each rollout id in [--profile-step-start,
--profile-step-end) and each target of --profile-target, one gzipped Chrome trace is written:
`<dir>/<target>_rollout<id>.pt.trace.json.gz` (Perfetto, chrome://tracing and TensorBoard's
profile plugin open it), with <dir> --tensorboard-dir if given, else RUN_DIR/profile, and one
line printed per file. The profiler options are Miles': shapes, stacks, memory and FLOPs.

torch.profiler sessions do not nest (a second one ends the first), so with train_overall
traced the whole rollout is one session, and the inner targets' files are cut from its trace:
the events inside their `millstream.<target>` range. Without it each inner target is its own
session.

--memory-snapshot-path: from the start of the window's first train step to the end of its
last, the CUDA caching allocator's history is recorded (torch.cuda.memory
._record_memory_history, stacks as Miles takes them), and dumped to the path after each of the
window's train steps (the last dump holds the whole window; a run that stops early keeps what
it had), and after a train step that raised (an out-of-memory one, say). It needs a CUDA GPU:
preflight refuses it without one, and so does this class. The torch backend keeps the model
on the CPU, so today the snapshot holds only the trainer's CUDA buffers.

Where this differs from Miles: every target counts rollout ids (Miles counts the rollouts since
the process started for train_overall, so a resumed run shifts its window, and micro-batches
for train_actor and train_log_probs); one file per rollout rather than one per window; traces
from rank 0 only (Megatron's --profile-ranks default); Miles also dumps the memory snapshot
from an out-of-memory observer, here only at the end of a train step (a raising one too).
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from millstream.common.config import RunConfig
from millstream.common.config.profiling import MEMORY_SNAPSHOT_NEEDS_CUDA, PROFILE_TARGETS
from millstream.common.errors import MillstreamError

OVERALL = "train_overall"
MEMORY_ENTRIES = 1_000_000  # Miles' max_entries of the recorded allocator history


def event_name(target: str) -> str:
    """The record_function range a target's region is recorded as."""
    return f"millstream.{target}"


def trace_dir(cfg: RunConfig) -> Path:
    return Path(cfg.logging.tensorboard_dir or Path(cfg.run_dir, "profile"))


def trace_path(directory: Path, target: str, rollout_id: int) -> Path:
    return directory / f"{target}_rollout{rollout_id}.pt.trace.json.gz"


class TrainProfiler:
    """Context managers per target, active for rollout ids in [start, end). Built without
    arguments it profiles nothing (the backend's default)."""

    def __init__(
        self,
        targets: Iterable[str] = (),
        start: int = 0,
        end: int = 0,
        out_dir: str | Path = ".",
        memory_snapshot_path: str | Path | None = None,
        say: Callable[[str], None] = lambda line: print(f"[trainer] {line}", flush=True),
    ):
        self.targets = frozenset(targets)
        unknown = self.targets - set(PROFILE_TARGETS)
        if unknown:
            raise ValueError(f"unknown profile targets {sorted(unknown)}: {PROFILE_TARGETS}")
        self.start, self.end = start, end
        self.out_dir = Path(out_dir)
        self.memory_path = Path(memory_snapshot_path) if memory_snapshot_path else None
        if self.memory_path is not None and not torch.cuda.is_available():
            raise MillstreamError(MEMORY_SNAPSHOT_NEEDS_CUDA)
        self.say = say
        self.written: list[Path] = []  # every trace and snapshot file, in order
        self._session: Any = None  # the open torch.profiler.profile
        self._nested: list[str] = []  # targets recorded inside the open session
        self._recording_memory = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> TrainProfiler:
        p = cfg.profiling
        profiler = cls(
            p.profile_target if p.use_pytorch_profiler else (),
            p.profile_step_start,
            p.profile_step_end,
            trace_dir(cfg),
            p.memory_snapshot_path,
        )
        if profiler.targets:
            # Start Kineto here, in the building thread: its first start in the training
            # thread logs "External init callback must run in same thread as registerClient".
            with profile(activities=[ProfilerActivity.CPU]):
                pass
        if profiler.enabled:
            what = []
            if profiler.targets:
                what.append(f"traces of {', '.join(p.profile_target)} to {profiler.out_dir}")
            if profiler.memory_path is not None:
                what.append(f"CUDA memory history to {profiler.memory_path.resolve()}")
            profiler.say(
                f"profiling rollouts [{p.profile_step_start}, {p.profile_step_end}) (0-based): "
                + "; ".join(what)
            )
        return profiler

    @property
    def enabled(self) -> bool:
        return bool(self.targets) or self.memory_path is not None

    def in_window(self, rollout_id: int) -> bool:
        return self.enabled and self.start <= rollout_id < self.end

    @contextlib.contextmanager
    def target(self, name: str, rollout_id: int) -> Iterator[None]:
        """Profile `name`'s region of rollout `rollout_id` (a no-op outside the window)."""
        if name not in PROFILE_TARGETS:
            raise ValueError(f"unknown profile target {name!r}: {PROFILE_TARGETS}")
        if not self.in_window(rollout_id):
            yield
            return
        memory = name == OVERALL and self.memory_path is not None
        if memory and not self._recording_memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES, stacks="all")
            self._recording_memory = True
        opens = name in self.targets and self._session is None
        if opens:
            self._session = self._new_session()
            self._session.start()
        ok = False
        try:
            with record_function(event_name(name)):
                yield
            ok = True
        finally:
            if opens:
                self._close_session(name, rollout_id, export=ok)
            elif name in self.targets:
                self._nested.append(name)
            if memory:
                self._dump_memory(rollout_id, last=rollout_id >= self.end - 1 or not ok)

    # -- traces --------------------------------------------------------------------------------

    def _new_session(self) -> Any:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        return profile(
            activities=activities,
            record_shapes=True,
            with_stack=True,
            profile_memory=True,
            with_flops=True,
        )

    def _close_session(self, owner: str, rollout_id: int, export: bool) -> None:
        session, nested = self._session, self._nested
        self._session, self._nested = None, []
        session.stop()
        if not export:
            return  # the train step raised: its error matters, not a partial trace
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = trace_path(self.out_dir, owner, rollout_id)
        # Plain JSON first, compressed here: torch's own .gz export compresses at level 9,
        # several times slower for about the same size.
        plain = path.with_name(f".{path.name}.tmp")
        session.export_chrome_trace(str(plain))
        try:
            raw = plain.read_bytes()
        finally:
            plain.unlink(missing_ok=True)
        _write_gz(path, raw)
        self._wrote(owner, rollout_id, path)
        if not nested:
            return
        doc = json.loads(raw)
        for inner in nested:
            part = slice_trace(doc, event_name(inner))
            if part is None:
                continue
            inner_path = trace_path(self.out_dir, inner, rollout_id)
            _write_gz(inner_path, json.dumps(part).encode())
            self._wrote(inner, rollout_id, inner_path)

    def _wrote(self, target: str, rollout_id: int, path: Path) -> None:
        self.written.append(path)
        self.say(f"profile of {target}, rollout {rollout_id}: {path}")

    # -- memory --------------------------------------------------------------------------------

    def _dump_memory(self, rollout_id: int, last: bool) -> None:
        assert self.memory_path is not None
        self.memory_path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.memory_path))
        if last:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
        self.written.append(self.memory_path)
        self.say(
            f"CUDA memory snapshot through rollout {rollout_id}: {self.memory_path.resolve()} "
            "(open it in https://pytorch.org/memory_viz)"
        )


def _write_gz(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(gzip.compress(data, compresslevel=6))
    tmp.replace(path)  # a reader never sees half a file


def slice_trace(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The trace `doc` cut to the first complete event called `name`: its metadata events
    and every event that starts inside that range (flow arrows only with both ends inside).
    None when there is no such event."""
    events = doc.get("traceEvents", [])
    span = next((e for e in events if e.get("ph") == "X" and e.get("name") == name), None)
    if span is None:
        return None
    lo, hi = float(span["ts"]), float(span["ts"]) + float(span.get("dur", 0))

    def inside(e: dict[str, Any]) -> bool:
        return "ts" in e and lo <= float(e["ts"]) <= hi

    flow_ends: dict[tuple[Any, Any], int] = {}
    for e in events:
        if e.get("ph") in ("s", "f") and inside(e):
            key = (e.get("cat"), e.get("id"))
            flow_ends[key] = flow_ends.get(key, 0) + 1
    kept = [
        e
        for e in events
        if e.get("ph") == "M"
        or (e.get("ph") in ("s", "f") and flow_ends.get((e.get("cat"), e.get("id"))) == 2)
        or (e.get("ph") not in ("M", "s", "f") and inside(e))
    ]
    return {**doc, "traceEvents": kept}
