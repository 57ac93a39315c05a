"""The peer bench's bookkeeping (bench/bench_vs_peers.py): one wall-clock window for every
peer, the same cores, threads and device for every peer, the run order, where the cores of a
step went, the goals with the bound each prints, and the resources printed with the tables."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pytest import approx

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import bench_vs_peers as bench
from proctree import MACHINE, STEAL, CpuSampler


def test_rounds_run_in_abba_order_twice_by_default():
    assert bench.run_order(["ref", "sync", "async"], 2) == [
        ("ref", 0), ("sync", 0), ("async", 0), ("async", 1), ("sync", 1), ("ref", 1),
    ]  # fmt: skip
    assert bench.run_order(["ref"], 1) == [("ref", 0)]
    args = bench.parse_args([])
    assert args.rounds == 2
    assert (args.cores, args.device) == (len(os.sched_getaffinity(0)), "cpu")


# -- one window for every peer ---------------------------------------------------------------

# One run's wall clock, the same for every kind of peer: the eval before step 1 from t=100 to
# 102, four steps of 1 s, an eval of 2 s after step 2 and one after step 4 (outside the
# window). The window: 2 s of eval, 4 steps, the 2 s eval after step 2: 8 s for 4 x 128
# completions.
EVAL_S, STEP_S, T0 = 2.0, 1.0, 100.0
STEP_ENDS = [103.0, 104.0, 107.0, 108.0]
WINDOW_S = 8.0


def spec(peer: str = "ref", **fields) -> bench.Spec:
    defaults = {"peer": peer, "config": "small", "seed": 0, "model_dir": "m", "train_path": "t",
                "eval_path": "e", "lr": 3e-5, "eval_every": 2, "steps": 4, "seconds": None,
                "cpus": [0], "device": "cpu", "out_dir": "/tmp/out"}  # fmt: skip
    return bench.Spec(**(defaults | fields))


class Clock:
    """A fake time.time() on which an eval takes EVAL_S."""

    def __init__(self):
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def evaluate(self) -> float:
        self.now += EVAL_S
        return 0.5


def run_recorder(s: bench.Spec) -> dict:
    """An in-process peer (ref, TRL) on the clock above, driven as run_reference drives it."""
    clock = Clock()
    rec = bench.Recorder(s, clock.evaluate, clock=clock)
    rec.start()
    while not rec.done():
        clock.now += STEP_S
        rec.step(1.0)
    return rec.trace(wall_s=20.0)


def write_millstream_run(run_dir: Path, span_steps: int = 4) -> None:
    """A millstream run on the clock above whose own timings say each step took 0.5 s
    (total_time): a metrics row after each step (and its eval, and 1 ms of logging), the
    trainer's spans for the first `span_steps` iterations (a run stopped by SIGINT may miss
    the last)."""

    def span(name: str, start: float, end: float, **fields) -> dict:
        return {"name": name, "start_ns": int(start * 1e9), "end_ns": int(end * 1e9),
                "attributes": {}, "span_id": f"{len(spans):016x}", "parent_span_id": None} | fields  # fmt: skip

    rows, spans = [], []
    spans.append(span("trainer.eval", T0, T0 + EVAL_S, attributes={"millstream.iteration": 0}))
    for k, end in enumerate(STEP_ENDS, start=1):
        evals = k % 2 == 0
        row = {"step": k, "time": end + (EVAL_S if evals else 0.0) + 0.001, "total_time": 0.5,
               "rollout_time": 0.2, "train_time": 0.2, "sync_time": 0.1, "raw_reward": 0.5}  # fmt: skip
        if evals:
            row |= {"eval/arith": 0.5, "eval/arith_seconds": EVAL_S}
        rows.append(row)
        if k > span_steps:
            continue
        it = {"millstream.iteration": k}
        iteration = span("trainer.iteration", end - STEP_S, row["time"], attributes=it)
        spans += [iteration, span("trainer.weight_sync", end - 0.1, end,
                                  parent_span_id=iteration["span_id"])]  # fmt: skip
        if evals:
            spans.append(span("trainer.eval", end, end + EVAL_S, attributes=it))
    (run_dir / "traces").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = "".join(json.dumps(s) + "\n" for s in spans)
    (run_dir / "traces" / "trainer-7.jsonl").write_text(lines)
    (run_dir / "summary.json").write_text(json.dumps({"eval_curve": [[0, 0.0, {"arith": 0.4}]]}))


def test_every_kind_of_peer_is_timed_by_the_wall_clock_over_the_same_window(tmp_path: Path):
    ref = run_recorder(spec("ref"))
    write_millstream_run(tmp_path)
    sync = bench.millstream_trace(tmp_path, None) | {"wall_s": 20.0}
    for trace in (ref, sync):
        assert trace["window_s"] == approx(WINDOW_S)
        assert [s["seconds"] for s in trace["steps"]] == approx([e - T0 for e in STEP_ENDS])
        # an eval sits at the end of the step whose weights it evaluates
        assert [(e["step"], e["seconds"]) for e in trace["evals"]] == [(0, 0.0), (2, 4.0), (4, 8.0)]
    assert [s["step_s"] for s in ref["steps"]] == approx([1.0] * 4)
    # millstream's own step timings add up to 2 s; the wall clock says 8 s, evals included
    assert sum(s["step_s"] for s in sync["steps"]) == approx(2.0)
    rows = {p: bench.summarise([t], [2, 4], [4.0]) for p, t in (("ref", ref), ("sync", sync))}
    for peer, median_step in (("ref", 1.0), ("sync", 0.5)):
        assert rows[peer]["overall_cps"] == approx(4 * bench.BATCH / WINDOW_S)
        assert rows[peer]["median_step_cps"] == approx(bench.BATCH / median_step)
        assert rows[peer]["acc_at_seconds"] == {4.0: 0.5}
    assert (rows["ref"]["outside_s"], rows["sync"]["outside_s"]) == approx((4.0, 6.0))


def test_a_step_whose_span_was_not_written_ends_where_its_metrics_row_says(tmp_path: Path):
    write_millstream_run(tmp_path, span_steps=3)
    trace = bench.millstream_trace(tmp_path, None)
    # the row's time less its eval: 1 ms later than the span would have said
    assert trace["window_s"] == approx(WINDOW_S + 0.001)


def test_a_millstream_run_without_the_eval_span_before_step_1_is_refused(tmp_path: Path):
    write_millstream_run(tmp_path)
    (tmp_path / "traces" / "trainer-7.jsonl").write_text("")
    with pytest.raises(RuntimeError, match=r"trainer\.eval span of iteration 0"):
        bench.millstream_trace(tmp_path, None)


def test_a_wall_budget_ends_every_peers_window_after_the_first_step_past_it(tmp_path: Path):
    # 4.5 s: step 2 ends at 4 s, step 3 at 7 s (after the eval): both windows end with step 3
    ref = run_recorder(spec("ref", steps=None, seconds=4.5))
    write_millstream_run(tmp_path)  # millstream went on to step 4 before its SIGINT took
    assert bench.window_so_far(tmp_path) == approx(WINDOW_S + 0.001)
    sync = bench.millstream_trace(tmp_path, 4.5)
    for trace in (ref, sync):
        assert [s["step"] for s in trace["steps"]] == [1, 2, 3]
        assert trace["window_s"] == approx(7.0)
        assert [e["step"] for e in trace["evals"]] == [0, 2]


# -- the same cores, threads and device for every peer ---------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_peer_gets_the_same_cpus_threads_and_environment(device: str):
    base = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0", "OTEL_SDK_DISABLED": "true",
            "OMP_NUM_THREADS": "2"}  # fmt: skip
    launches = [bench.launch(spec(p, cpus=[0, 1, 2], device=device), base) for p in bench.PEERS]
    assert {(ln.cpus, ln.threads) for ln in launches} == {((0, 1, 2), 3)}
    assert len({json.dumps(ln.env, sort_keys=True) for ln in launches}) == 1
    env = launches[0].env
    assert env["CUDA_VISIBLE_DEVICES"] == ("" if device == "cpu" else "0")
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "3"
    assert "OTEL_SDK_DISABLED" not in env  # millstream's window is read from its span files
    ref, trl, sync, asyn = (ln.argv for ln in launches)
    assert "--worker" in ref and "--worker" in trl
    assert (sync[1], asyn[1]) == ("train", "train-async")


def test_a_pinned_peer_and_millstream_inside_it_see_only_the_given_cores():
    cpus = bench.given_cpus(1)
    probe = (
        "import os; from millstream.common.threads import machine_cores; "
        "print(sorted(os.sched_getaffinity(0)), machine_cores(), "
        "repr(os.environ['CUDA_VISIBLE_DEVICES']))"
    )
    env = bench.peer_env(cpus, "cpu", os.environ)
    how = bench.Launch([sys.executable, "-c", probe], env, tuple(cpus))
    out, _ = how.popen(stdout=subprocess.PIPE, text=True).communicate(timeout=60)
    assert out.split() == [str(cpus), "1", "''"]
    with pytest.raises(SystemExit, match="--cores"):
        bench.given_cpus(len(os.sched_getaffinity(0)) + 1)


# -- where the cores went, the goals, the report -----------------------------------------------


def sampler(times: list[float], samples: list[dict]) -> CpuSampler:
    cpu = CpuSampler(1)
    cpu.times, cpu.samples = times, samples
    return cpu


def test_cpu_profile_counts_only_back_to_back_steps_and_the_cpu_before_the_first_request(
    tmp_path: Path,
):
    # Steps end at t=10, 11, 12 and 14: the last row also held a 1 s eval, so it is left out.
    rows = [{"step": 1, "time": 10.0, "total_time": 1.0}, {"step": 2, "time": 11.0, "total_time": 1.0},
            {"step": 3, "time": 12.0, "total_time": 1.0}, {"step": 4, "time": 14.0, "total_time": 1.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "traces").mkdir()
    spans = [{"name": "trainer.step", "start_ns": 8_000_000_000},
             {"name": "send run:prompts", "start_ns": 6_000_000_000},
             {"name": "trainer.eval", "start_ns": 5_000_000_000},
             {"name": "trainer.batch_wait", "start_ns": 10_000_000_000, "end_ns": 10_300_000_000},
             {"name": "trainer.batch_wait", "start_ns": 11_000_000_000, "end_ns": 11_100_000_000}]  # fmt: skip
    (tmp_path / "traces" / "trainer-1.jsonl").write_text(
        "".join(json.dumps(s) + "\n" for s in spans)
    )
    # Generation inside the waits: 0.2 s of two overlapping requests in the first (0.05 s of
    # it before the wait began), 0.04 s in the second; one request outside any wait.
    gens = [(9.95, 10.1), (10.05, 10.2), (11.02, 11.06), (12.0, 12.5)]
    (tmp_path / "traces" / "engine-2.jsonl").write_text("".join(
        json.dumps({"name": "text_completion model", "start_ns": int(a * 1e9), "end_ns": int(b * 1e9)}) + "\n"
        for a, b in gens
    ))  # fmt: skip
    # The engine uses 0.5 core-s a second, the trainer 1; the machine 2 (0.5 not ours).
    times = [0.0, 20.0]
    samples = [{"engine": 0.0, "trainer": 0.0, MACHINE: 0.0, STEAL: 0.0},
               {"engine": 10.0, "trainer": 20.0, MACHINE: 40.0, STEAL: 2.0}]  # fmt: skip
    profile = bench.cpu_profile(tmp_path, sampler(times, samples), started_at=1.0)
    assert profile["steps"] == 2
    assert profile["step_wall_s"] == approx(1.0)
    assert profile["step_cpu_s"] == approx({"engine": 0.5, "trainer": 1.0})
    assert (profile["step_other_s"], profile["step_steal_s"]) == approx((0.5, 0.1))
    assert profile["start_s"] == approx(4.0)  # the eval at t=5 asked first
    assert profile["start_cpu_s"] == approx({"engine": 2.0, "trainer": 4.0})
    assert profile["generation_s"] == approx((0.2 + 0.04) / 2)  # the median of 0.2 and 0.04


def test_each_ratio_goal_prints_the_bound_the_cpu_work_sets_over_the_window():
    # Every peer: 10 steps and 0.5 s of its window outside them (its evals).
    run = {"steps": 10, "outside_s": 0.5}
    rows = {"ref": run | {"overall_cps": 1000.0, "median_step_cps": 1000.0,
                          "parts_s": {"rollout_s": 0.04, "train_s": 0.088, "step_s": 0.128}},
            "trl": run | {"overall_cps": 800.0, "median_step_cps": 800.0, "parts_s": {"step_s": 0.16}},
            "sync": run | {"overall_cps": 640.0, "median_step_cps": 640.0,
                           "parts_s": {"rollout_s": 0.07, "train_s": 0.11, "sync_s": 0.02, "step_s": 0.2}},
            "async": run | {"overall_cps": 800.0, "median_step_cps": 800.0,
                            "parts_s": {"rollout_s": 0.0, "train_s": 0.14, "sync_s": 0.02, "step_s": 0.16}}}  # fmt: skip
    profiles = {
        "sync": {"step_wall_s": 0.2, "step_cpu_s": {"trainer": 0.2, "engine": 0.08},
                 "start_s": 6.0, "start_cpu_s": {"trainer": 6.0, "engine": 5.0}, "eval_s": 0.25,
                 "generation_s": 0.04},
        "async": {"step_wall_s": 0.16, "step_cpu_s": {"trainer": 0.2, "engine": 0.08}},
    }  # fmt: skip

    def window_cps(step_s: float) -> float:  # 10 steps that long and the 0.5 s of evals
        return 10 * bench.BATCH / (10 * step_s + 0.5)

    cores = 2
    goals = {g[0]: g for g in bench.goal_rows("small", rows, [], 1, profiles, cores)}
    _, _, measured, met, note = goals["train-async / train"]
    assert (measured, met) == ("1.25x", True)
    # 280 ms of CPU a step (sync's and async's alike): at least 140 ms on 2 cores
    assert f"async/sync <= {window_cps(0.14) / 640:.2f}x with sync's work" in note
    assert f"<= {window_cps(0.14) / 640:.2f}x with its own work" in note
    _, _, measured, met, note = goals["train / TRL"]
    assert (measured, met) == ("0.80x", False)
    assert "rollout 70 ms" in note and "TRL's step 160 ms" in note
    # 40 ms generating, 30 ms of hand-offs; 70 ms + ref's 88 ms train + a 20 ms sync: 178 ms
    assert "40 ms of generation and 30 ms of hand-offs" in note
    assert f"a 178 ms step: train/TRL <= {window_cps(0.178) / 800:.2f}x" in note
    _, _, measured, met, note = goals["train's first rollout request"]
    assert not met and f"at least {11.0 / cores:.1f} s on {cores} cores" in note
    assert goals["train's 200-problem eval"][3]  # 0.25 s <= 0.3 s
    medium = {g[0]: g for g in bench.goal_rows("medium", rows, [], 1, profiles, cores)}
    assert "train's 200-problem eval" not in medium
    _, _, measured, met, note = medium["train-async / TRL"]
    assert (measured, met) == ("1.00x", False)
    assert "280 ms of CPU work" in note
    assert f"async/TRL <= {window_cps(0.14) / 800:.2f}x" in note


RESOURCES = {"cpu_model": "Test CPU 9000", "cores_total": 8, "cores_usable": 8,
             "memory_gib": 31.2, "cpus": [0, 1, 2, 3], "cores_given": 4, "device": "cpu",
             "gpu": None, "commit": "abc1234+dirty", "python": "3.11.9", "torch": "2.13.0+cpu",
             "transformers": "5.24.0", "trl": "1.16.0"}  # fmt: skip


def saved_trace(step_s: float, threads: str) -> dict:
    steps = [{"step": k, "step_s": step_s, "end": k * step_s, "train_s": step_s / 2}
             for k in range(1, 5)]  # fmt: skip
    evals = [{"step": k, "accuracy": 0.5, "eval_s": 0.1} for k in (0, 2, 4)]
    trace = bench.in_window(0.0, steps, evals, None)  # no eval time: window = the steps
    return trace | {"wall_s": 10.0, "cpus": [0, 1, 2, 3], "device": "cpu", "threads": threads}


def test_report_prints_a_saved_runs_resources_and_tables_again(tmp_path: Path, capsys):
    saved = {"resources": RESOURCES, "settings": {"seeds": [0], "eval_every": 2},
             "configs": {"small": {"traces": {"ref": [saved_trace(0.1, "4 torch threads")],
                                              "sync": [saved_trace(0.2, "CPU budget: 4 core(s)")]}}}}  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    bench.main(["--report", str(path)])
    out = capsys.readouterr().out
    assert f"(from {path})" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("resources:"))
    table = next(i for i, line in enumerate(lines) if "c/s window" in line)
    assert header < table
    assert (
        "Test CPU 9000, 4 of 8 cores given (CPUs 0-3), 31.2 GiB memory, device cpu; "
        "commit abc1234+dirty; torch 2.13.0+cpu, transformers 5.24.0, trl 1.16.0"
    ) in lines[header]
    assert "CPUs 0-3, cpu, 4 torch threads" in lines[header + 1]
    assert "CPUs 0-3, cpu, CPU budget: 4 core(s)" in lines[header + 2]
    # 128 completions a step over the window: 1280/s for ref, 640/s for sync, which is 0.50x ref
    rows = [line for line in lines if "1280" in line or "640" in line]
    assert any("reference loop" in line for line in rows)
    assert any("millstream train" in line and "0.50" in line for line in rows)


def test_report_refuses_a_run_saved_before_the_window(tmp_path: Path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"machine": "machine: old", "settings": {}, "configs": {}}))
    with pytest.raises(SystemExit, match="wall-clock window"):
        bench.main(["--report", str(path)])
