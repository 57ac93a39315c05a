"""The GPU bench (bench/bench_gpu.py): its goals, its table and its sizes. Its CPU smoke run (the
tiny model, every section but `make run`'s, a real engine and router) is the bench stage of
`make gpu-check`'s plumbing test, tests/unit/test_gpu_check.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_gpu as bench


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
