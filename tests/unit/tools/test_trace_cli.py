"""`millstream trace` on hand-made span files whose numbers are known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from millstream.common.errors import MillstreamError
from millstream.common.telemetry import GROUP_ID, GROUP_IDS, MIRROR_OF, STAGE
from millstream.tools import trace_cli

MS = 1_000_000
T0 = 1_800_000_000_000 * MS  # ns since the epoch


class Spans:
    """Writes spans as telemetry.JsonlSpanExporter does, with times in ms from T0."""

    def __init__(self, first_id: int = 0) -> None:
        self.lines: list[dict] = []
        self._next = first_id

    def add(self, name, trace, start_ms, end_ms, *, parent=None, stage=None, group=None,
            links=(), service="svc", **attrs) -> str:  # fmt: skip
        self._next += 1
        span_id = f"{self._next:016x}"
        attributes = dict(attrs)
        if stage:
            attributes[STAGE] = stage
        if group:
            attributes[GROUP_ID] = group
        self.lines.append({
            "name": name, "service": service, "trace_id": trace, "span_id": span_id,
            "parent_span_id": parent, "start_ns": T0 + int(start_ms * MS),
            "end_ns": T0 + int(end_ms * MS), "status": "UNSET", "attributes": attributes,
            "links": [{"trace_id": "x", "span_id": s} for s in links], "events": [],
        })  # fmt: skip
        return span_id

    def group(self, gid: str, trace: str, t: float, rollout_ms: float,
              generate: bool = True) -> tuple[str, str]:  # fmt: skip
        """One group's lifecycle from t: admit, 10 ms queued, rollout (router, engine inside
        unless not `generate`), 5 ms queued, 20 ms reward. Returns (its rollout span, its
        buffer-wait span)."""
        admit = self.add("send r:prompts", trace, t, t + 1, stage="admit", group=gid)
        self.add("wait r:prompts", trace, t + 1, t + 11, parent=admit, stage="prompts_wait",
                 group=gid)  # fmt: skip
        end = t + 11 + rollout_ms
        roll = self.add("process r:prompts", trace, t + 11, end, parent=admit, stage="rollout",
                        group=gid)  # fmt: skip
        if generate:
            router = self.add("router.proxy", trace, t + 12, end - 1, parent=roll, stage="router")
            self.add("text_completion m", trace, t + 13, end - 2, parent=router, stage="engine")
        self.add("wait r:generated", trace, end, end + 5, parent=roll, stage="generated_wait",
                 group=gid)  # fmt: skip
        reward = self.add("process r:generated", trace, end + 5, end + 25, parent=roll,
                          stage="reward", group=gid)  # fmt: skip
        buffered = self.add("wait r:scored", trace, end + 25, end + 30, parent=reward,
                            stage="buffer_wait", group=gid)  # fmt: skip
        return roll, buffered

    def iteration(self, it: int, trace: str, t: float, links: list[str]) -> str:
        """An iteration from t: a 30 ms batch wait, a 100 ms step, a 20 ms sync, 10 ms more."""
        span = self.add("trainer.iteration", trace, t, t + 160, stage="iteration",
                        **{"millstream.iteration": it})  # fmt: skip
        self.add("trainer.batch_wait", trace, t, t + 30, parent=span, stage="batch_wait")
        self.add("trainer.step", trace, t + 30, t + 130, parent=span, stage="train_step",
                 links=links)  # fmt: skip
        self.add("trainer.weight_sync", trace, t + 130, t + 150, parent=span,
                 stage="weight_sync", links=links)  # fmt: skip
        return span

    def write(self, run_dir: Path, torn: bool = False, name: str = "all-1.jsonl") -> Path:
        (run_dir / "traces").mkdir(parents=True)
        text = "".join(json.dumps(line) + "\n" for line in self.lines)
        (run_dir / "traces" / name).write_text(text + ('{"name": "tor' if torn else ""))
        return run_dir


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Two groups trained in iteration 1: g-slow arrives last (rollout 100 ms), so the
    iteration's batch wait (t=100..130 ms) is spent in g-slow's reward (its 20 ms) and its
    buffer wait; then an eval round linked to the iteration."""
    s = Spans()
    _, fast = s.group("g-fast", "t1", 5, rollout_ms=20)  # in the buffer at 61 ms
    _, slow = s.group("g-slow", "t2", 0, rollout_ms=84)  # reward 100..120, buffered at 120
    it = s.iteration(1, "t3", 100, links=[fast, slow])
    root = s.add("trainer.eval", "t4", 260, 300, stage="eval", links=[it],
                 **{"millstream.iteration": 1})  # fmt: skip
    s.add("process r:prompts", "t4", 262, 290, parent=root, stage="rollout", group="eval-a-r1-i0")
    return s.write(tmp_path / "run", torn=True)


def test_reads_every_span_and_counts_a_torn_line(run_dir: Path):
    spans, unreadable = trace_cli.read_spans(run_dir)
    assert len(spans) == 2 * 8 + 4 + 2 and unreadable == 1


def test_stage_table_has_every_stage_in_lifecycle_order(run_dir: Path):
    run = trace_cli.Run.index(trace_cli.read_spans(run_dir)[0])
    table = trace_cli.stage_table(run)
    assert list(table)[:10] == [
        "admit", "prompts_wait", "rollout", "router", "engine", "generated_wait", "reward",
        "buffer_wait", "train_step", "weight_sync",
    ]  # fmt: skip
    assert table["rollout"] == pytest.approx([0.020, 0.028, 0.084])
    assert table["reward"] == pytest.approx([0.020, 0.020])
    assert table["train_step"] == pytest.approx([0.100])


def test_critical_path_charges_the_batch_wait_to_the_last_group(run_dir: Path):
    run = trace_cli.Run.index(trace_cli.read_spans(run_dir)[0])
    parts, wall, n = trace_cli.critical_path(run)
    assert (n, wall) == (1, pytest.approx(0.160))
    # The wait 100..130 ms: g-slow was in its reward until 120, then in the buffer.
    assert parts["reward"] == pytest.approx(0.020)
    assert parts["batch_wait"] == pytest.approx(0.010)
    assert parts["train_step"] == pytest.approx(0.100)
    assert parts["weight_sync"] == pytest.approx(0.020)
    assert parts[trace_cli.TRAINER_OTHER] == pytest.approx(0.010)
    assert sum(parts.values()) == pytest.approx(wall)


def test_groups_are_found_through_parents_links_and_eval_rounds(run_dir: Path):
    run = trace_cli.Run.index(trace_cli.read_spans(run_dir)[0])
    assert run.trained_in == {"g-fast": 1, "g-slow": 1}
    assert run.group_iteration("eval-a-r1-i0") == 1
    timeline = trace_cli.group_timeline(run, "g-slow")
    names = [s.name for s in timeline]
    assert "text_completion m" in names  # the engine span, found through its parents
    assert names[-2:] == ["trainer.step", "trainer.weight_sync"]
    (slowest, seconds, where), *_ = trace_cli.slowest_groups(run, 1)
    assert slowest == "g-slow" and seconds == pytest.approx(0.250)  # 0 .. the sync's end
    assert where["engine"] == pytest.approx(0.080)


def test_a_coalesced_request_belongs_to_every_group_it_carried(tmp_path: Path):
    s = Spans()
    first, _ = s.group("g1", "t1", 0, rollout_ms=50)
    other = s.add("process r:prompts", "t2", 10, 70, stage="rollout", group="g2")
    batch = s.add("POST", "t1", 20, 40, parent=first, links=[other])
    s.add("router.proxy", "t1", 21, 39, parent=batch, stage="router")
    run = trace_cli.Run.index(trace_cli.read_spans(s.write(tmp_path / "run"))[0])
    names = [x.name for x in trace_cli.group_timeline(run, "g2")]
    assert names == ["process r:prompts", "POST", "router.proxy"]


@pytest.mark.parametrize("names", ["group_ids", "links", "neither"])
def test_a_batch_router_and_engine_span_is_in_every_served_groups_timeline(tmp_path, names):
    """A batch's router and engine spans sit in its first group's trace; the groups they name
    (millstream.group_ids) or link to put them in every served group's timeline too."""
    s = Spans()
    roll1, buf1 = s.group("g1", "t1", 0, rollout_ms=50, generate=False)
    roll2, buf2 = s.group("g2", "t2", 2, rollout_ms=50, generate=False)
    served = {GROUP_IDS: ["g1", "g2"]} if names == "group_ids" else {}
    links = [roll1, roll2] if names == "links" else []
    router = s.add("router.proxy", "t1", 14, 58, parent=roll1, stage="router", links=links,
                   **served)  # fmt: skip
    s.add("text_completion m", "t1", 15, 57, parent=router, stage="engine", links=links, **served)
    s.iteration(1, "t3", 100, links=[buf1, buf2])
    run = trace_cli.Run.index(trace_cli.read_spans(s.write(tmp_path / "run"))[0])
    for gid in ("g1", "g2"):
        stages = [x.stage for x in trace_cli.group_timeline(run, gid)]
        if names == "neither" and gid == "g2":
            assert "router" not in stages and "engine" not in stages
        else:
            assert stages.count("router") == stages.count("engine") == 1
    whole = names != "neither"
    assert trace_cli.not_whole(run) == ({} if whole else {"g2": ["router", "engine"]})
    selected = run.select(range(1, 2), None)  # narrowing keeps what a group borrowed
    assert trace_cli.not_whole(selected) == trace_cli.not_whole(run)


def test_spans_that_services_wrote_beside_the_run_dir_are_read_for_its_traces(tmp_path, capsys):
    """compose: router and engines outlive runs and write /runs/services/traces; the trace of
    /runs/arith takes their spans of its own traces, and no other run's."""
    s = Spans()
    roll, buf = s.group("g1", "t1", 0, rollout_ms=50, generate=False)
    s.iteration(1, "t3", 100, links=[buf])
    run_dir = s.write(tmp_path / "runs" / "arith")
    shared = Spans(first_id=1000)
    router = shared.add("router.proxy", "t1", 12, 58, parent=roll, stage="router", service="r")
    shared.add("text_completion m", "t1", 13, 57, parent=router, stage="engine", service="e")
    shared.add("router.proxy", "another-run", 12, 58, stage="router", service="r")
    shared.write(tmp_path / "runs" / "services", name="router-host-1.jsonl")
    spans, _ = trace_cli.read_spans(run_dir)
    assert {x.service for x in spans} == {"svc", "r", "e"} and len(spans) == len(s.lines) + 2
    assert trace_cli.not_whole(trace_cli.Run.index(spans)) == {}
    assert trace_cli.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "from 1 file(s) and 1 shared" in out and "whole traces: 1 of 1 trained groups" in out


def test_mirror_copies_are_left_out_of_the_summary_and_read_by_the_trace_they_are_in(tmp_path):
    """telemetry.mirror's copies of a shared span, one in each group's trace: `millstream trace`
    counts the original alone; read_mirrors hands the copies back by trace (the shared files'
    of the run's own traces only)."""
    s = Spans()
    _, buf1 = s.group("g1", "t1", 0, rollout_ms=50)
    roll2, buf2 = s.group("g2", "t2", 0, rollout_ms=50, generate=False)  # rode g1's request
    s.iteration(1, "t3", 100, links=[buf1, buf2])
    step = next(x["span_id"] for x in s.lines if x["name"] == "trainer.step")
    router = next(x["span_id"] for x in s.lines if x["name"] == "router.proxy")
    for trace, parent in (("t1", buf1), ("t2", buf2)):
        s.add("trainer.step", trace, 130, 230, parent=parent, stage="train_step", links=[step],
              **{MIRROR_OF: step})  # fmt: skip
    run_dir = s.write(tmp_path / "runs" / "arith")
    shared = Spans(first_id=1000)
    shared.add("router.proxy", "t2", 12, 58, parent=roll2, stage="router", service="r",
               links=[router], **{MIRROR_OF: router})  # fmt: skip
    shared.add("router.proxy", "another-run", 12, 58, stage="router", service="r",
               **{MIRROR_OF: "00000000000000ff"})  # fmt: skip
    shared.write(tmp_path / "runs" / "services", name="router-host-1.jsonl")

    spans, _ = trace_cli.read_spans(run_dir)
    assert len(spans) == len(s.lines) - 2 and not any(x.mirror_of for x in spans)
    assert len(trace_cli.stage_table(trace_cli.Run.index(spans))["train_step"]) == 1
    copies = trace_cli.read_mirrors(run_dir)
    assert {
        trace: [(c.name, c.parent, c.mirror_of) for c in cs] for trace, cs in copies.items()
    } == {
        "t1": [("trainer.step", buf1, step)],
        "t2": [("trainer.step", buf2, step), ("router.proxy", roll2, router)],
    }


def test_iteration_and_since_narrow_what_is_counted(run_dir: Path):
    run = trace_cli.Run.index(trace_cli.read_spans(run_dir)[0])
    assert set(run.select(range(2, 3), None).groups) == set()
    assert set(run.select(range(1, 2), None).groups) == {"g-fast", "g-slow", "eval-a-r1-i0"}
    late = run.select(None, 0.2)  # what started 200 ms or more after the first span
    assert set(late.groups) == {"eval-a-r1-i0"} and not late.iterations


def test_cli_prints_tables_and_a_waterfall(run_dir: Path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    assert trace_cli.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "1 unreadable line(s) skipped" in out
    for word in ("stages (ms)", "critical path of 1 iteration(s)", "slowest", "g-slow"):
        assert word in out
    assert trace_cli.main([str(run_dir), "--group", "g-slow"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("group g-slow: 0.250 s")
    bars = {line.split()[0]: line for line in lines[2:]}
    assert "█" in bars["trainer.weight_sync"]
    # Bars are placed by start time: the admission first, the step after the engine.
    assert bars["send"].index("█") < bars["text_completion"].index("█")
    assert bars["text_completion"].index("█") < bars["trainer.step"].index("█")


def test_clear_errors(tmp_path: Path, run_dir: Path):
    with pytest.raises(MillstreamError, match="no span files in"):
        trace_cli.main([str(tmp_path / "nothing")])
    with pytest.raises(MillstreamError, match="no spans of group 'nope'"):
        trace_cli.print_waterfall(Console(), trace_cli.Run.index([]), "nope")
    with pytest.raises(SystemExit):
        trace_cli.main([str(run_dir), "--iteration", "x-y"])
