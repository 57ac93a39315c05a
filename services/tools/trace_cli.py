"""`millstream trace RUN_DIR`: where a run's groups spent their time, from its JSONL spans.

Every service writes its spans to `RUN_DIR/traces/<service>-<host>-<pid>.jsonl` (telemetry.py).
Services that outlive a run write under their own run dir: compose's router and engines use
`/runs/services`, beside the runs, so for `RUN_DIR` this also reads `RUN_DIR/../services/traces`,
keeping only the spans of traces the run's own files hold (no other run's, no health checks).
Each span of a group's lifecycle carries `millstream.stage`; a group's trace runs from its
admission to its buffer wait, and the trainer's per-iteration spans (its own root,
`trainer.iteration`) link to the groups they trained. A span of a request that served several
groups (a coalesced /generate and its router and engine spans) belongs to each of them: it
names them in `millstream.group_ids` and links to their spans (telemetry.py). This prints:

  whole      how many trained groups have a whole trace (WHOLE_TRACE: every stage from the
             admission, the router and engine included, to the sync that shipped it);
  stages     count, p50, p95 and max seconds of every stage (telemetry.STAGES);
  critical   the share of an iteration's wall-clock each stage holds on its critical path:
             the train step, the weight sync and the eval are the trainer's own time; the
             batch wait is charged to whatever the batch's LAST group was doing meanwhile
             (its rollout, engine, reward, a queue), since the batch was ready only then;
  slowest    the groups with the longest admission-to-sync time, and where that time went;
  --group    one group's waterfall: its spans, and the train step and sync that shipped it.

`--iteration N` or `A-B` keeps the groups trained (or eval rounds run) in those iterations;
`--since S` keeps what started S seconds or more after the run's first span (skip warm-up).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from millstream.common.errors import MillstreamError
from millstream.common.telemetry import GROUP_ID, GROUP_IDS, MIRROR_OF, STAGE, STAGES

ITERATION = "millstream.iteration"
# Stages that belong to the trainer's iteration, not to one group.
TRAINER_STAGES = ("iteration", "batch_wait", "train_step", "weight_sync", "eval")
# What a group does before it is in the buffer (its critical path while the trainer waits).
GROUP_STAGES = ("prompts_wait", "rollout", "router", "engine", "generated_wait", "reward",
                "reward_task")  # fmt: skip
# A trained group's whole trace: every stage of its life, to the sync that shipped it.
WHOLE_TRACE = ("admit", "prompts_wait", "rollout", "router", "engine", "generated_wait", "reward",
               "buffer_wait", "train_step", "weight_sync")  # fmt: skip
# Beside a run dir: where services that outlive runs write (compose's --run-dir /runs/services).
SHARED_TRACES = Path("..", "services", "traces")
BETWEEN = "(between services)"
TRAINER_OTHER = "(trainer: batch, log, checkpoint)"
COLORS = {
    "admit": "white", "prompts_wait": "yellow", "rollout": "cyan", "router": "blue",
    "engine": "magenta", "generated_wait": "yellow", "reward": "green", "reward_task": "green",
    "buffer_wait": "yellow", "train_step": "red", "weight_sync": "bright_red",
}  # fmt: skip


@dataclass(slots=True)
class Span:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent: str | None
    start: int  # ns since the epoch
    end: int
    stage: str | None
    attrs: dict[str, Any]
    links: list[str]  # span ids this span links to
    group: str | None = None

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9

    @property
    def mirror_of(self) -> str | None:
        """The span id of the shared span this is a copy of (`read_mirrors`), else None."""
        return self.attrs.get(MIRROR_OF)


def span_files(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """The run's own span files, and those of services that outlive runs (SHARED_TRACES)."""
    own = sorted((run_dir / "traces").glob("*.jsonl"))
    shared_dir = (run_dir / SHARED_TRACES).resolve()
    if shared_dir == (run_dir / "traces").resolve():  # RUN_DIR is the services' own
        return own, []
    return own, sorted(shared_dir.glob("*.jsonl"))


def read_spans(run_dir: Path) -> tuple[list[Span], int]:
    """Every span of the run (module docstring: its own files, then the shared ones' spans of
    its traces), and how many lines could not be read (a process killed mid-write leaves a torn
    last line)."""
    own, shared = span_files(run_dir)
    if not own:
        raise MillstreamError(
            f"no span files in {run_dir / 'traces'}: spans are written there when a run has a "
            "run dir and OTEL_EXPORTER_OTLP_ENDPOINT is not set (then they go to the collector)"
        )
    spans, unreadable = _read(own, None)
    more, torn = _read(shared, {s.trace_id for s in spans})
    return spans + more, unreadable + torn


def read_mirrors(run_dir: Path) -> dict[str, list[Span]]:
    """The copies `telemetry.mirror` made of the run's shared spans (a train step, a weight
    sync, a batch request's router and engine spans), by the trace each was copied into: a
    group's own. `read_spans` skips them, since the originals count and this module follows
    their links; the copies are what a trace viewer, one trace at a time, shows of those
    stages in a group's trace."""
    spans, _ = read_spans(run_dir)
    own, shared = span_files(run_dir)
    copies = _read(own, None, copies=True)[0]
    copies += _read(shared, {s.trace_id for s in spans}, copies=True)[0]
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for copy in copies:
        by_trace[copy.trace_id].append(copy)
    return dict(by_trace)


def _read(
    files: list[Path], traces: set[str] | None, copies: bool = False
) -> tuple[list[Span], int]:
    """The spans in `files` (of `traces` only, when given) and the count of unreadable lines;
    the originals, or with `copies` the mirror copies (MIRROR_OF) alone."""
    spans, unreadable = [], 0
    for path in files:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                try:
                    d = json.loads(line)
                    if traces is not None and d["trace_id"] not in traces:
                        continue
                    attrs = d["attributes"]
                    if (MIRROR_OF in attrs) != copies:
                        continue
                    spans.append(
                        Span(
                            d["name"], d["service"], d["trace_id"], d["span_id"],
                            d["parent_span_id"], d["start_ns"], d["end_ns"], attrs.get(STAGE),
                            attrs, [link["span_id"] for link in d["links"]], attrs.get(GROUP_ID),
                        )
                    )  # fmt: skip
                except (ValueError, KeyError, TypeError):
                    unreadable += 1
    return spans, unreadable


@dataclass
class Run:
    """The spans of a run, indexed by span, trace, group and iteration."""

    spans: list[Span]
    by_id: dict[str, Span] = field(default_factory=dict)
    children: dict[str, list[Span]] = field(default_factory=lambda: defaultdict(list))
    groups: dict[str, list[Span]] = field(default_factory=lambda: defaultdict(list))
    iterations: dict[int, Span] = field(default_factory=dict)
    trained_in: dict[str, int] = field(default_factory=dict)  # group -> iteration
    batches: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    shipped_by: dict[str, list[Span]] = field(default_factory=lambda: defaultdict(list))
    # group -> spans of a request it shared with other groups, found by `millstream.group_ids`
    # or by a link to the group's span (with the linking span's children): a coalesced
    # /generate batch is a child of its first member's span alone
    borrowed: dict[str, list[Span]] = field(default_factory=lambda: defaultdict(list))
    evals: dict[int, list[Span]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def index(cls, spans: list[Span]) -> Run:
        run = cls(sorted(spans, key=lambda s: s.start))
        run.by_id = {s.span_id: s for s in run.spans}
        for s in run.spans:
            if s.parent:
                run.children[s.parent].append(s)
        for s in run.spans:
            s.group = run._group_of(s)
            if s.group is not None:
                run.groups[s.group].append(s)
            if s.stage == "iteration":
                run.iterations[int(s.attrs.get(ITERATION, 0))] = s  # a resumed run: the last
        for s in run.spans:
            if s.stage in ("train_step", "weight_sync"):
                it = run.iteration_of(s)
                for span_id in s.links:
                    linked = run.by_id.get(span_id)
                    if linked is not None and linked.group is not None and it is not None:
                        run.trained_in[linked.group] = it
                        run.batches[it].add(linked.group)
                        run.shipped_by[linked.group].append(s)
            elif s.stage == "eval":
                run.evals[int(s.attrs.get(ITERATION, 0))].append(s)
        run._index_shared()
        return run

    def _index_shared(self) -> None:
        shared: dict[str, dict[str, Span]] = defaultdict(dict)  # group -> span id -> span
        linking: dict[str, list[Span]] = defaultdict(list)
        for s in self.spans:
            for gid in s.attrs.get(GROUP_IDS) or ():
                shared[gid][s.span_id] = s
            if s.stage not in TRAINER_STAGES:
                for span_id in s.links:
                    linking[span_id].append(s)
        for gid, own in self.groups.items():
            for s in own:
                for request in linking.get(s.span_id, ()):
                    for x in (request, *self.descendants(request)):
                        shared[gid][x.span_id] = x
        for gid, found in shared.items():
            if spans := [x for x in found.values() if x.group != gid]:
                self.borrowed[gid] = sorted(spans, key=lambda x: x.start)

    def descendants(self, s: Span) -> list[Span]:
        out, todo = [], list(self.children.get(s.span_id, ()))
        while todo:
            kid = todo.pop()
            out.append(kid)
            todo += self.children.get(kid.span_id, ())
        return out

    def _group_of(self, s: Span) -> str | None:
        """A span's group: its own attribute, else its nearest ancestor's (router, engine)."""
        seen = 0
        while s.group is None and s.parent in self.by_id and seen < 64:
            s, seen = self.by_id[s.parent], seen + 1
        return s.group

    def iteration_of(self, s: Span) -> int | None:
        while s.stage != "iteration":
            if s.parent not in self.by_id:
                return None
            s = self.by_id[s.parent]
        return int(s.attrs.get(ITERATION, 0))

    def select(self, iterations: range | None, since_s: float | None) -> Run:
        """The run narrowed to groups and iterations in `iterations`, started after `since_s`."""
        cutoff = self.spans[0].start + int((since_s or 0) * 1e9) if self.spans else 0

        def keep_iteration(it: int | None, start: int) -> bool:
            in_range = iterations is None or (it is not None and it in iterations)
            return in_range and start >= cutoff

        keep: dict[str, Span] = {}
        for gid, spans in self.groups.items():
            if keep_iteration(self.group_iteration(gid), spans[0].start):
                keep.update((s.span_id, s) for s in (*spans, *self.borrowed.get(gid, ())))
        for s in self.spans:
            if s.group is None and s.stage in TRAINER_STAGES:
                it = int(s.attrs[ITERATION]) if ITERATION in s.attrs else self.iteration_of(s)
                if keep_iteration(it, s.start):
                    keep[s.span_id] = s
        return Run.index(_fresh(keep.values())) if (iterations or since_s) else self

    def group_iteration(self, gid: str) -> int | None:
        """The iteration that trained a group, or the one whose eval round it belongs to."""
        if gid in self.trained_in:
            return self.trained_in[gid]
        for s in self.groups[gid]:
            root = self.by_id.get(s.parent or "")
            if root is not None and root.stage == "eval":
                return int(root.attrs.get(ITERATION, 0))
        return None


def _fresh(spans: Iterable[Span]) -> list[Span]:
    """Copies with the derived group cleared back to the span's own attribute."""
    return [
        Span(s.name, s.service, s.trace_id, s.span_id, s.parent, s.start, s.end, s.stage,
             s.attrs, s.links, s.attrs.get(GROUP_ID))
        for s in spans
    ]  # fmt: skip


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def stage_table(run: Run) -> dict[str, list[float]]:
    """Seconds of every span, by stage, in lifecycle order (unknown stages last)."""
    by_stage: dict[str, list[float]] = defaultdict(list)
    for s in run.spans:
        if s.stage:
            by_stage[s.stage].append(s.seconds)
    order = [st for st in STAGES if st in by_stage] + sorted(set(by_stage) - set(STAGES))
    return {st: sorted(by_stage[st]) for st in order}


def exclusive(spans: Sequence[Span], lo: int, hi: int) -> dict[str, float]:
    """Seconds of [lo, hi) charged to the innermost stage running at each instant (the one
    that started last); time no span covers is BETWEEN (hops, a consumer's poll)."""
    staged = [s for s in spans if s.stage and s.end > lo and s.start < hi]
    points = sorted({lo, hi, *(min(max(t, lo), hi) for s in staged for t in (s.start, s.end))})
    out: dict[str, float] = defaultdict(float)
    for a, b in pairwise(points):
        mid = (a + b) / 2
        covering = [s for s in staged if s.start <= mid < s.end]
        stage = max(covering, key=lambda s: s.start).stage if covering else BETWEEN
        out[stage or BETWEEN] += (b - a) / 1e9
    return out


def critical_path(run: Run) -> tuple[dict[str, float], float, int]:
    """Seconds per stage on the iterations' critical paths, their wall-clock, and the count."""
    total: dict[str, float] = defaultdict(float)
    wall = 0.0
    for it, span in sorted(run.iterations.items()):
        parts: dict[str, float] = defaultdict(float)
        for kid in run.children[span.span_id]:
            if kid.stage == "batch_wait":
                for stage, s in _batch_wait(run, kid, it).items():
                    parts[stage] += s
            elif kid.stage in ("train_step", "weight_sync"):
                parts[kid.stage] += kid.seconds
        for ev in run.evals.get(it, ()):  # an eval round runs inside its iteration
            if span.span_id in ev.links:
                parts["eval"] += max(0, min(ev.end, span.end) - max(ev.start, span.start)) / 1e9
        parts[TRAINER_OTHER] += max(0.0, span.seconds - sum(parts.values()))
        for stage, s in parts.items():
            total[stage] += s
        wall += span.seconds
    return total, wall, len(run.iterations)


def _batch_wait(run: Run, wait: Span, iteration: int) -> dict[str, float]:
    """A batch wait, charged to what the last group of the batch did while the trainer waited."""
    batch = run.batches.get(iteration, ())
    arrivals = {gid: s.start for gid in batch for s in run.groups[gid] if s.stage == "buffer_wait"}
    if not arrivals:
        return {"batch_wait": wait.seconds}
    last = max(arrivals, key=arrivals.__getitem__)
    ready = min(max(arrivals[last], wait.start), wait.end)
    parts: dict[str, float] = defaultdict(float)
    if ready > wait.start:
        path = [s for s in group_timeline(run, last) if s.stage in GROUP_STAGES]
        parts.update(exclusive(path, wait.start, ready))
    parts["batch_wait"] += (wait.end - ready) / 1e9
    return parts


def group_timeline(run: Run, gid: str) -> list[Span]:
    """A group's spans and the trainer spans that shipped it, in start order."""
    spans = [*run.groups.get(gid, ()), *run.borrowed.get(gid, ()), *run.shipped_by.get(gid, ())]
    return sorted(spans, key=lambda s: s.start)


def not_whole(run: Run) -> dict[str, list[str]]:
    """The trained groups whose trace is not whole, with the WHOLE_TRACE stages it lacks."""
    out = {}
    for gid in run.trained_in:
        stages = {s.stage for s in group_timeline(run, gid)}
        if missing := [st for st in WHOLE_TRACE if st not in stages]:
            out[gid] = missing
    return out


def slowest_groups(run: Run, n: int) -> list[tuple[str, float, dict[str, float]]]:
    """The n groups with the longest first-span-to-last-span time, with where it went."""
    spans_of = {gid: group_timeline(run, gid) for gid in run.groups}
    e2e = {gid: (sp[-1].end if sp else 0) - sp[0].start for gid, sp in spans_of.items() if sp}
    out = []
    for gid in sorted(e2e, key=e2e.__getitem__, reverse=True)[:n]:
        spans = spans_of[gid]
        hi = max(s.end for s in spans)
        out.append((gid, e2e[gid] / 1e9, exclusive(spans, spans[0].start, hi)))
    return out


# -- printing ---------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def print_whole(console: Console, run: Run) -> None:
    broken = not_whole(run)
    trained = len(run.trained_in)
    line = f"whole traces: {trained - len(broken):,} of {trained:,} trained groups"
    if broken:
        lacking: dict[str, int] = defaultdict(int)
        for missing in broken.values():
            for stage in missing:
                lacking[stage] += 1
        line += "; the others lack " + ", ".join(f"{st} ({n:,})" for st, n in lacking.items())
    console.print(line)


def print_stages(console: Console, run: Run) -> None:
    table = Table(title="stages (ms)", title_justify="left")
    for col in ("stage", "count", "p50", "p95", "max"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage, values in stage_table(run).items():
        table.add_row(
            stage, f"{len(values):,}", _ms(percentile(values, 50)), _ms(percentile(values, 95)),
            _ms(values[-1]),
        )  # fmt: skip
    console.print(table)


def print_critical_path(console: Console, run: Run) -> None:
    parts, wall, n = critical_path(run)
    if not n:
        console.print("critical path: no trainer.iteration spans (was the trainer traced?)")
        return
    table = Table(
        title=f"critical path of {n} iteration(s), {wall / n:.3f} s each on average",
        title_justify="left",
    )
    for col in ("stage", "s / iteration", "share"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for stage, s in sorted(parts.items(), key=lambda kv: kv[1], reverse=True):
        table.add_row(stage, f"{s / n:.3f}", f"{100 * s / wall:.1f}%" if wall else "-")
    console.print(table)


def print_slowest(console: Console, run: Run, n: int) -> None:
    table = Table(title=f"slowest {n} groups (admission to sync)", title_justify="left")
    for col in ("group", "iteration", "seconds", "where"):
        table.add_column(col, justify="right" if col in ("iteration", "seconds") else "left")
    for gid, seconds, where in slowest_groups(run, n):
        top = sorted(where.items(), key=lambda kv: kv[1], reverse=True)[:3]
        it = run.group_iteration(gid)
        table.add_row(
            gid, "-" if it is None else str(it), f"{seconds:.3f}",
            ", ".join(f"{stage} {s:.3f}s" for stage, s in top),
        )  # fmt: skip
    console.print(table)


def print_waterfall(console: Console, run: Run, gid: str) -> None:
    spans = group_timeline(run, gid)
    if not spans:
        known = sorted(run.groups)[:5]
        raise MillstreamError(f"no spans of group {gid!r} (some groups of this run: {known})")
    t0, t1 = spans[0].start, max(s.end for s in spans)
    ids = {s.span_id for s in spans}

    def depth(s: Span) -> int:
        d = 0
        while s.parent in ids and d < 16:
            s, d = run.by_id[s.parent], d + 1
        return d

    label_w, bar_w = 44, max(20, console.width - 44 - 24)
    scale = bar_w / max(1, t1 - t0)
    console.print(f"group {gid}: {(t1 - t0) / 1e9:.3f} s from first span to last")
    for s in spans:
        label = ("  " * depth(s) + s.name)[: label_w - 1].ljust(label_w)
        first = int((s.start - t0) * scale)
        width = max(1, int((s.end - s.start) * scale))
        line = Text(label)
        line.append(f"{(s.start - t0) / 1e6:>9,.1f} {s.seconds * 1e3:>9,.1f} ms  ")
        line.append(" " * first + "█" * min(width, bar_w - first + 1), COLORS.get(s.stage or ""))
        line.append(f"  {s.service}", "dim")
        console.print(line, no_wrap=True, overflow="crop", soft_wrap=False)


def parse_iterations(text: str) -> range:
    try:
        lo, _, hi = text.partition("-")
        return range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N or A-B") from None


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="millstream trace",
        description="Where a run's groups spent their time, from RUN_DIR/traces/*.jsonl "
        "(and RUN_DIR/../services/traces: compose's router and engines).",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--group", metavar="ID", help="draw this group's waterfall")
    parser.add_argument("--iteration", type=parse_iterations, metavar="N|A-B")
    parser.add_argument("--since", type=float, metavar="SECONDS",
                        help="only what started SECONDS or more after the run's first span")  # fmt: skip
    parser.add_argument("--slowest", type=int, default=5, metavar="N")
    args = parser.parse_args(argv)

    spans, unreadable = read_spans(args.run_dir)
    run = Run.index(spans).select(args.iteration, args.since)
    console = Console(highlight=False)
    own, shared = span_files(args.run_dir)
    files = f"{len(own)} file(s)" + (f" and {len(shared)} shared" if shared else "")
    note = f", {unreadable} unreadable line(s) skipped" if unreadable else ""
    console.print(
        f"{len(spans):,} spans from {files}{note}; {len(run.groups):,} groups, "
        f"{len(run.iterations)} iterations selected"
    )
    if args.group:
        print_waterfall(console, run, args.group)
        return 0
    print_whole(console, run)
    print_stages(console, run)
    print_critical_path(console, run)
    print_slowest(console, run, args.slowest)
    return 0
