"""The peer bench's bookkeeping (bench/bench_vs_peers.py): the run order, where the cores of
a step went, and the goals with the bound each prints."""

import json
import sys
from pathlib import Path

from pytest import approx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_vs_peers as bench
from proctree import MACHINE, STEAL, CpuSampler


def test_rounds_run_in_abba_order():
    assert bench.run_order(["ref", "sync", "async"], 2) == [
        ("ref", 0), ("sync", 0), ("async", 0), ("async", 1), ("sync", 1), ("ref", 1),
    ]  # fmt: skip
    assert bench.run_order(["ref"], 1) == [("ref", 0)]


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


def test_each_ratio_goal_prints_the_bound_the_cpu_work_sets():
    rows = {"ref": {"overall_cps": 1000.0, "median_step_cps": 1000.0,
                    "parts_s": {"rollout_s": 0.04, "train_s": 0.088, "step_s": 0.128}},
            "trl": {"overall_cps": 800.0, "median_step_cps": 800.0, "parts_s": {"step_s": 0.16}},
            "sync": {"overall_cps": 640.0, "median_step_cps": 640.0,
                     "parts_s": {"rollout_s": 0.07, "train_s": 0.11, "sync_s": 0.02, "step_s": 0.2}},
            "async": {"overall_cps": 800.0, "median_step_cps": 800.0,
                      "parts_s": {"rollout_s": 0.0, "train_s": 0.14, "sync_s": 0.02, "step_s": 0.16}}}  # fmt: skip
    profiles = {
        "sync": {"step_wall_s": 0.2, "step_cpu_s": {"trainer": 0.2, "engine": 0.08},
                 "start_s": 6.0, "start_cpu_s": {"trainer": 6.0, "engine": 5.0}, "eval_s": 0.25,
                 "generation_s": 0.04},
        "async": {"step_wall_s": 0.16, "step_cpu_s": {"trainer": 0.2, "engine": 0.08}},
    }  # fmt: skip
    goals = {g[0]: g for g in bench.goal_rows("small", rows, [], 1, profiles)}
    _, _, measured, met, note = goals["train-async / train"]
    assert (measured, met) == ("1.25x", True)
    assert f"async/sync <= {bench.CORES * 0.2 / 0.28:.2f}x with sync's work" in note
    _, _, measured, met, note = goals["train / TRL"]
    assert (measured, met) == ("0.80x", False)
    assert "rollout 70 ms" in note and "TRL's step 160 ms" in note
    # 40 ms generating, 30 ms of hand-offs; 70 ms + ref's 88 ms train + a 20 ms sync: 160 / 178
    assert "40 ms of generation and 30 ms of hand-offs" in note
    assert "a 178 ms step: train/TRL <= 0.90x" in note
    _, _, measured, met, note = goals["train's first rollout request"]
    assert not met and f"at least {11.0 / bench.CORES:.1f} s" in note
    assert goals["train's 200-problem eval"][3]  # 0.25 s <= 0.3 s
    medium = {g[0]: g for g in bench.goal_rows("medium", rows, [], 1, profiles)}
    assert "train's 200-problem eval" not in medium
    _, _, measured, met, note = medium["train-async / TRL"]
    assert (measured, met) == ("1.00x", False)
    assert "280 ms of CPU work" in note
    assert f"async/TRL <= {0.16 * bench.CORES / 0.28:.2f}x" in note


def test_report_prints_a_saved_runs_tables_again(tmp_path: Path, capsys):
    def trace(step_s: float) -> dict:
        steps = [{"step": k, "step_s": step_s, "seconds": k * step_s, "train_s": step_s / 2}
                 for k in range(1, 5)]  # fmt: skip
        evals = [{"step": k, "seconds": k * step_s, "accuracy": 0.5, "eval_s": 0.1}
                 for k in (0, 2, 4)]  # fmt: skip
        return {"steps": steps, "evals": evals, "wall_s": 10.0}

    saved = {"machine": "machine: test", "settings": {"seeds": [0], "eval_every": 2},
             "configs": {"small": {"traces": {"ref": [trace(0.1)], "sync": [trace(0.2)]}}}}  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    bench.main(["--report", str(path)])
    out = capsys.readouterr().out
    assert "machine: test" in out and f"(from {path})" in out
    # 128 completions a step: 1280/s for ref, 640/s for sync, which is 0.50x ref
    lines = [line for line in out.splitlines() if "1280" in line or "640" in line]
    assert any("reference loop" in line for line in lines)
    assert any("millstream train" in line and "0.50" in line for line in lines)
