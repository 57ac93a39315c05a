"""`make gpu-check` (bench/gpu_check.py, scripts/gpu_check.sh) on a machine without a GPU: its
plumbing for real (`--device cpu --small`: the GPU-marked tests collected and skipped, bench_gpu.py's
CPU smoke run with a real engine and router, the table), and its verdicts on made-up results:
a failed test, a stage out of time, an arith run that synced without CUDA IPC, a goal not met."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_gpu
import gpu_check

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_plumbing_on_the_cpu_runs_every_gpu_test_file_and_the_bench(tmp_path):
    out = tmp_path / "out"
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n{gpu_check.DOCS_START}\nnot run yet\n{gpu_check.DOCS_END}\n")
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--small", "--stages",
         "tests,contract,bench", "--out", str(out), "--docs", str(docs)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=400,
        env={**os.environ, "PY": sys.executable},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    rows = {check: (measured, verdict) for check, measured, _, verdict in report["rows"]}
    # Every GPU-marked test was collected, and skipped here (torch sees no GPU).
    tests = {c: v for c, v in rows.items() if c.startswith("test ")}
    assert len(tests) >= 10, tests
    assert {v for _, v in tests.values()} == {"skip"}
    assert any("test_cuda_ipc" in c for c in tests), sorted(tests)
    # the contract tier's, with SGLang's package on the path as make test puts it
    assert (
        "test test_tensor_route::test_sglang_reads_the_trainers_cuda_tensors_over_cuda_ipc" in tests
    )
    assert docs.read_text().count("not run yet") == 1  # --device cpu never writes the docs
    # bench_gpu.py's CPU smoke run: every row measured, the goals judged.
    bench = json.loads((out / "bench.json").read_text())
    sections = [r["section"] for r in bench["rows"]]
    assert sections.count("train") == 3 and sections.count("sync") == 2
    # HF generate, one row per concurrency, the FP8 engine (no graphs-off row on a CPU), and
    # the decode step over a small and a large pool
    assert sections.count("engine") == 4 + len(bench_gpu.SIZES["concurrency"][1].split(","))
    for r in bench["rows"]:
        assert r["value"] is not None and r["value"] > 0 and r["ratio"] > 0, r
    (fp8,) = [r for r in bench["rows"] if r["extra"].get("fp8")]
    assert fp8["note"].endswith("x the bf16 engine")
    (synced,) = [r for r in bench["rows"] if "route" in r["extra"]]
    assert "shared memory" in synced["name"]  # the CPU's tensor route
    assert [g["name"] for g in bench["goals"]] == [
        "train step, --bf16 vs the plain bf16 loop",
        "engine at concurrency 4 vs HF generate",
        "FP8 engine vs the bf16 engine",
        "decode step, large pool vs small",
        "colocated weight update, ms per GB",
    ]
    bench_rows = [v for c, v in rows.items() if c.split(":")[0] in ("train", "engine", "sync")]
    assert len(bench_rows) == len(bench["rows"])
    assert {v for _, v in bench_rows} <= {"PASS", "BELOW"}
    # A peak per phase, the table with the commit, and no FAIL.
    assert set(report["stages"]) == {"tests", "contract", "bench"}
    assert all(s["peak_mib"] > 0 for s in report["stages"].values())
    table = (out / "table.md").read_text()
    assert table.startswith(f"Measured by `make gpu-check` at commit {report['commit']}")
    assert "0 FAIL" in table and table.count("| peak host memory in use: ") == 3


def _junit(path: Path, cases: str) -> None:
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')


def test_test_rows_pass_fail_skip_and_none_collected(tmp_path):
    stage = {"rc": 1, "timed_out": False, "tail": ["1 failed"]}
    _junit(tmp_path / "gpu_tests.xml", (
        '<testcase classname="tests.unit.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.unit.test_a" name="test_bad" time="2">'
        '<failure message="AssertionError: 3 != 4">trace</failure></testcase>'
        '<testcase classname="tests.unit.test_b" name="test_gpu" time="0">'
        '<skipped message="gpu: needs a CUDA GPU"/></testcase>'
    ))  # fmt: skip
    rows = gpu_check.test_rows(tmp_path, stage)
    assert [(r[0], r[3]) for r in rows] == [
        ("test test_a::test_ok", "PASS"),
        ("test test_a::test_bad", "FAIL"),
        ("test test_b::test_gpu", "skip"),
    ]
    assert "AssertionError: 3 != 4" in rows[1][1]
    _junit(tmp_path / "gpu_tests.xml", "")
    assert gpu_check.test_rows(tmp_path, {"rc": 5, "timed_out": False, "tail": []})[0][3] == "FAIL"
    (tmp_path / "gpu_tests.xml").unlink()
    assert gpu_check.test_rows(tmp_path, stage)[0][3] == "FAIL"  # no report at all
    # the contract tier where sglang is not importable (its conftest's usage error): a skip
    absent = {"rc": 4, "timed_out": False, "tail": ["ERROR: ... sglang is not importable: ..."]}
    assert gpu_check.test_rows(tmp_path, absent, "contract")[0][3] == "skip"
    assert gpu_check.test_rows(tmp_path, {**absent, "rc": 1}, "contract")[0][3] == "FAIL"


def test_arith_rows_fail_without_85_percent_or_without_cuda_ipc():
    stage = {"rc": 0, "timed_out": False, "tail": []}

    def run(name, value, routes, tracebacks=0):
        return {"name": name, "value": value, "note": "" if value else "85% not reached",
                "extra": {"routes": routes, "best_eval": 0.9, "completions_per_s": 900.0,
                          "iterations": 40, "graph_captures": 12, "tracebacks": tracebacks}}  # fmt: skip

    ipc = ["tensor (same GPU: CUDA IPC)"]
    result = {"rows": [run("arith sync, GPU --colocate", 30.0, ipc),
                       run("arith async, GPU --colocate", 25.0, ["disk (fallback)"]),
                       run("arith sync, GPU --colocate", None, ipc),
                       run("arith async, GPU --colocate", 20.0, ipc, tracebacks=1)]}  # fmt: skip
    verdicts = [r[3] for r in gpu_check.arith_rows(result, stage, "cuda")]
    assert verdicts == ["PASS", "FAIL", "FAIL", "FAIL"]
    # On the CPU no route is CUDA IPC: that alone fails nothing.
    assert gpu_check.arith_rows(result, stage, "cpu")[1][3] == "PASS"
    assert gpu_check.arith_rows(None, stage, "cuda")[0][3] == "FAIL"


def test_bench_rows_a_goal_not_met_is_below_or_with_strict_a_failure():
    result = {
        "rows": [
            {"section": "train", "name": "millstream torch, --bf16", "value": 900.0,
             "unit": "tokens/s", "ratio": 0.7, "base": "plain loop", "detail": "", "note": ""},
            {"section": "engine", "name": "millstream engine", "value": None, "unit": "",
             "ratio": None, "base": "", "detail": "", "note": "failed: engine exited 1"},
        ],
        "goals": [{"row": "millstream torch, --bf16", "target": ">= 0.85x", "met": False}],
    }  # fmt: skip
    stage = {"rc": 0, "timed_out": False, "tail": []}
    assert [r[3] for r in gpu_check.bench_rows(result, stage, strict=False)] == ["BELOW", "FAIL"]
    assert [r[3] for r in gpu_check.bench_rows(result, stage, strict=True)] == ["FAIL", "FAIL"]
    assert "failed: engine exited 1" in gpu_check.bench_rows(result, stage, False)[1][1]


def test_a_stage_out_of_time_is_stopped_and_its_peak_sampled(tmp_path):
    start = time.monotonic()
    # -S: no site packages to import, so the child is surely running Python's own SIGINT
    # handler when the signal comes, even on a loaded machine (a 2 s start-up once was not).
    # The child sets that handler itself: a test run started in the background by a shell
    # without job control inherits SIGINT ignored, and so would the child.
    code = (
        "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "print('working'); time.sleep(60)"
    )
    child = [sys.executable, "-S", "-c", code]
    stage = gpu_check.run_stage("slow", child, 3.0, tmp_path, "cpu")
    assert stage["timed_out"] and stage["rc"] != 0
    assert time.monotonic() - start < 30
    assert stage["peak_mib"] > 0 and stage["tail"][-1] == "KeyboardInterrupt"  # SIGINT first
    assert (tmp_path / "slow.log").read_text().startswith("working\n")


def test_a_stage_that_fails_makes_the_check_exit_1(tmp_path, monkeypatch):
    monkeypatch.setattr(
        gpu_check, "stage_argv", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    code = gpu_check.main(["--device", "cpu", "--stages", "bench", "--out", str(tmp_path)])
    assert code == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    verdicts = {row[0]: row[3] for row in report["rows"]}
    assert verdicts["stage bench"] == "FAIL" and verdicts["bench_gpu.py"] == "FAIL"


def test_publish_writes_between_the_markers_once(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(
        f"# B\n\nbefore\n\n{gpu_check.DOCS_START}\nold\n{gpu_check.DOCS_END}\n\nafter\n"
    )
    report = {"commit": "abc1234", "date": "2026-11-27", "seconds": 400.0,
              "environment": {"card": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2,
                              "capability": "9.0", "driver": "580", "python": "3.12",
                              "torch": "2.11.0+cu130", "cuda": "13.0", "transformers": "5.17.0"},
              "rows": [["test t::a", "passed in 1.0 s", "pass", "PASS"],
                       ["train: x", "1 tokens/s", ">= 0.85x", "BELOW"]]}  # fmt: skip
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(report))
    for _ in range(2):
        assert gpu_check.main(["--publish", str(path), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert "old" not in text and text.count("at commit abc1234 on NVIDIA H100 80GB HBM3") == 1
    assert "1 PASS, 1 BELOW a goal, 0 FAIL" in text
    assert text.startswith("# B\n\nbefore\n") and text.endswith("after\n")
    docs.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        gpu_check.main(["--publish", str(path), "--docs", str(docs)])


def test_bench_gpu_names_its_commit_without_git(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git to be found
    monkeypatch.setenv("MILLSTREAM_COMMIT", "abc1234")
    assert bench_gpu.git_commit() == "abc1234"
    monkeypatch.delenv("MILLSTREAM_COMMIT")
    assert bench_gpu.git_commit() == "unknown"
