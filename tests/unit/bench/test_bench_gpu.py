"""The GPU bench (bench/bench_gpu.py): its goals, its table, its sizes, its results file
written after every row, and the colocated arith run's command. Its CPU smoke run (the tiny
model, every section, a real engine and router, a short colocated arith run) is the bench and
arith stages of `make gpu-check`'s plumbing test, tests/integration/gpu/test_gpu_check.py."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import bench_gpu as bench
import gpu_bench_run


def test_goals_and_a_section_not_run(capsys):
    rows = [
        bench.Row("train", "millstream torch, --bf16", 900.0, "tokens/s", 0.9, "plain loop"),
        bench.Row("engine", "millstream engine (HTTP), concurrency 1", 50.0, "tokens/s", 0.5,
                  extra={"concurrency": 1}),
        bench.Row("engine", "millstream engine (HTTP), concurrency 64", 600.0, "tokens/s", 6.0,
                  extra={"concurrency": 64}),
        # the graphs-off and FP8 variants at the same concurrency are not the goal's row
        bench.Row("engine", "millstream engine, CUDA graphs off, concurrency 64", 300.0,
                  "tokens/s", 3.0, extra={"concurrency": 64, "graphs": False}),
        bench.Row("engine", "millstream engine FP8, concurrency 64", 200.0, "tokens/s", 2.0,
                  extra={"concurrency": 64, "fp8": True}),
        bench.Row("sync", "WeightSync.sync pause->continue", 30.0, "ms", 3.0,
                  extra={"route": "tensor", "ms_per_gb": 30.3}),
        bench.Row("run", "arith sync, GPU --colocate", None, "s to 85%",
                  note="not run: --colocate refused"),
    ]  # fmt: skip
    goals = bench.goals(rows)
    assert [(g["row"], g["met"]) for g in goals] == [
        ("millstream torch, --bf16", True),
        ("millstream engine (HTTP), concurrency 64", True),
        ("WeightSync.sync pause->continue", False),
    ]
    res = {"device_name": "NVIDIA H100", "torch": "2", "transformers": "5", "commit": "abc",
           "cpu_model": "x", "cores_usable": 16, "cores_total": 16, "memory_gib": 128,
           "model": "m"}  # fmt: skip
    bench.print_table(res, rows, goals)
    table = capsys.readouterr().out
    assert "| run | arith sync, GPU --colocate | not run: --colocate refused | - |" in table
    assert ">= 0.85x: 0.9x, met" in table and "<= 20 ms/GB: 30.3 ms/GB, NOT met" in table


def test_small_sizes_fill_in_and_a_given_flag_wins():
    args = bench.parse_args(["--small", "--device", "cpu", "--new-tokens", "8"])
    assert (args.batch, args.seq_len, args.new_tokens) == (4, 32, 8)
    assert args.concurrency == [1, 4] and args.only == list(bench.SECTIONS)
    full = bench.parse_args([])
    assert (full.batch, full.seq_len, full.concurrency, full.device) == (
        64,
        512,
        [1, 16, 64],
        "cuda",
    )


def _summary(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({
        "eval_curve": [[0, 1.0, {"arith": 0.4}], [5, 9.5, {"arith": 0.9}]],
        "completions_per_s": 800.0, "iteration": 6,
    }))  # fmt: skip


def test_a_run_cut_short_keeps_every_row_written_before(tmp_path, monkeypatch):
    """make gpu-check's stage limit interrupts bench_gpu.py (SIGINT): the rows of the runs
    that ended are in --json already, `done` still false."""
    path = tmp_path / "arith.json"
    args = bench.parse_args(["--small", "--device", "cpu", "--only", "run", "--no-cpu-run",
                             "--arith-modes", "sync,async", "--json", str(path)])  # fmt: skip
    results = bench.Results(path, {"only": args.only}, bench.goals)

    def arith_run(mode, on_device, args, where):
        if mode == "async":
            raise KeyboardInterrupt
        return {"to_85_s": 9.5, "completions_per_s": 800.0, "wall_s": 20.0, "iterations": 6}

    monkeypatch.setattr(gpu_bench_run, "arith_run", arith_run)
    with pytest.raises(KeyboardInterrupt):
        gpu_bench_run.run_section(args, tmp_path, results.add)
    written = json.loads(path.read_text())
    assert [r["name"] for r in written["rows"]] == ["arith sync, CPU --colocate"]
    assert written["rows"][0]["value"] == 9.5 and written["done"] is False
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed


def test_the_colocated_arith_run_caps_the_engines_pool(tmp_path, monkeypatch):
    """run.sh gets --colocate and --sglang-max-total-tokens (the engine's --max-total-tokens);
    the CPU's `make run` gets neither, and no GPU."""
    arith = tmp_path / "arith"
    arith.mkdir()
    (arith / "run.sh").write_text(
        'echo "$MODE|${CUDA_VISIBLE_DEVICES-unset}|$*" > "$RUN_DIR.args"\n'
        'mkdir -p "$RUN_DIR" && cp "$SUMMARY" "$RUN_DIR/summary.json"\n'
    )
    _summary(tmp_path / "proto")
    monkeypatch.setenv("SUMMARY", str(tmp_path / "proto" / "summary.json"))
    monkeypatch.setattr(gpu_bench_run, "ARITH", arith)
    args = bench.parse_args(["--small", "--device", "cpu", "--arith-rollouts", "6"])
    got = gpu_bench_run.arith_run("async", True, args, tmp_path)
    mode, _, flags = (tmp_path / "arith-async-dev.args").read_text().strip().split("|")
    assert mode == "train-async"
    assert flags == f"--colocate --sglang-max-total-tokens {bench.ARITH_MAX_TOTAL_TOKENS}"
    assert got["to_85_s"] == 9.5 and got["iterations"] == 6 and got["max_total_tokens"] == 16384
    gpu_bench_run.arith_run("sync", False, args, tmp_path)
    assert (tmp_path / "arith-sync-cpu.args").read_text().strip() == "train||"
