"""The GPU bench (bench/bench_gpu.py) in its CPU smoke mode: the tiny model, every section but
`make run`'s, one real engine and router; every row measured, the goals judged."""

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_gpu as bench

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_run_measures_every_row(tmp_path):
    out = tmp_path / "bench_gpu.json"
    argv = ["--device", "cpu", "--small", "--only", "train,engine,sync", "--json", str(out)]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", *argv],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert time.monotonic() - start < 240
    result = json.loads(out.read_text())
    rows = result["rows"]
    sections = [r["section"] for r in rows]
    assert sections.count("train") == 3
    # HF generate, one row per concurrency, and the FP8 engine at the highest
    assert sections.count("engine") == 2 + len(bench.SIZES["concurrency"][1].split(","))
    assert sections.count("sync") == 2
    assert set(sections) == {"train", "engine", "sync"}
    for r in rows:
        assert r["value"] is not None and r["value"] > 0, r
        assert r["ratio"] is not None and r["ratio"] > 0, r
        assert r["note"] == "" or r["extra"].get("fp8"), r
    (fp8,) = [r for r in rows if r["extra"].get("fp8")]
    assert fp8["note"].endswith("x the bf16 engine")
    assert any(r["name"] == "millstream torch, --bf16" for r in rows)
    assert "shared memory" in rows[-1]["name"]  # the CPU's tensor route
    assert [g["unit"] for g in result["goals"]] == ["x", "x", " ms/GB"]
    assert all(isinstance(g["met"], bool) for g in result["goals"])
    res = result["resources"]
    assert res["device_name"].startswith("CPU, ") and res["commit"]
    # The one table, with the machine above it and a progress line per measurement.
    assert proc.stdout.startswith("device: CPU, ")
    assert proc.stdout.count("| train |") == 3 and "| sync |" in proc.stdout
    assert proc.stderr.count("train: ") == 3 and "engine: concurrency 4" in proc.stderr


def test_goals_and_a_section_not_run(capsys):
    rows = [
        bench.Row("train", "millstream torch, --bf16", 900.0, "tokens/s", 0.9, "plain loop"),
        bench.Row("engine", "millstream engine (HTTP), concurrency 1", 50.0, "tokens/s", 0.5,
                  extra={"concurrency": 1}),
        bench.Row("engine", "millstream engine (HTTP), concurrency 64", 600.0, "tokens/s", 6.0,
                  extra={"concurrency": 64}),
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
