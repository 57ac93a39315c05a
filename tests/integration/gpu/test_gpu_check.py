"""`make gpu-check` (bench/gpu_check.py, scripts/gpu_check.sh) on a machine without a GPU: its
plumbing for real (`--device cpu --small`: every stage as on a GPU, the GPU-marked tests
collected in the window's order and skipped, bench_gpu.py's CPU smoke run with a real engine
and router, a short colocated arith run, at most 8 files out), and its parts: the rows of
tests reported as they ran (a pytest killed mid-test keeps what it wrote), the budget, a
stage's process tree ended on timeout even where a child left its session, the verdicts."""

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import bench_gpu
import gpu_check
import gpu_pytest
import gpu_rows
import gpu_stage

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_plumbing_on_the_cpu_runs_every_stage_as_on_the_gpu(tmp_path):
    out = tmp_path / "out"
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n{gpu_rows.DOCS_START}\nnot run yet\n{gpu_rows.DOCS_END}\n")
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--device", "cpu", "--small", "--out", str(out),
         "--work", str(tmp_path / "work"), "--docs", str(docs)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=400,
        env={**os.environ, "PY": sys.executable},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # What a lent machine returns: at most 8 files, here the three of the design.
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "logs.tar.gz", "table.md"]
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report["stages"]) == set(gpu_check.STAGES) and report["complete"]
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?", report["commit"]), report["commit"]
    rows = [(check, measured, verdict) for check, measured, _, verdict in report["rows"]]
    # Every GPU-marked test was collected, and skipped here (torch sees no GPU), in the
    # window's order: the token pool's CUDA graphs first, the Megatron spawn last.
    tests = [(c, v) for c, _, v in rows if c.startswith("test ")]
    assert len(tests) >= 10 and {v for _, v in tests} == {"skip"}, tests
    assert tests[0][0].startswith("test test_token_pool::"), tests
    assert tests[-2][0].startswith("test test_megatron_model::"), tests
    # the contract tier's, with SGLang's package on the path as make test puts it
    assert tests[-1][0] == (
        "test test_tensor_route::test_sglang_reads_the_trainers_cuda_tensors_over_cuda_ipc"
    )
    assert docs.read_text().count("not run yet") == 1  # --device cpu never writes the docs
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {Path(n).relative_to("work").as_posix() for n in tar.getnames()}
        bench = json.load(tar.extractfile("work/bench.json"))  # type: ignore[arg-type]
    assert {"tests.log", "gpu_tests.jsonl", "contract.log", "bench.log", "arith.log",
            "arith.json"} <= names  # fmt: skip
    assert "arith/arith-async-dev/logs/engine-0.log" in names
    # bench_gpu.py's CPU smoke run: every row measured, the goals judged.
    sections = [r["section"] for r in bench["rows"]]
    assert bench["done"] and sections.count("train") == 3 and sections.count("sync") == 2
    # HF generate, one row per concurrency, the FP8 engine (no graphs-off row on a CPU), and
    # the decode step over a small and a large pool
    assert sections.count("engine") == 4 + len(bench_gpu.SIZES["concurrency"][1].split(","))
    for r in bench["rows"]:
        assert r["value"] is not None and r["value"] > 0 and r["ratio"] > 0, r
    (fp8,) = [r for r in bench["rows"] if r["extra"].get("fp8")]
    assert fp8["note"].endswith("x the bf16 engine")
    (synced,) = [r for r in bench["rows"] if "route" in r["extra"]]
    assert "shared memory" in synced["name"]  # the CPU's tensor route
    assert len(bench["goals"]) == 5
    bench_rows = [v for c, _, v in rows if c.split(":")[0] in ("train", "engine", "sync")]
    assert len(bench_rows) == len(bench["rows"]) and set(bench_rows) <= {"PASS", "BELOW"}
    # One colocated arith run (async), its pool capped, run to its end.
    (arith,) = [(c, m, v) for c, m, v in rows if c.startswith("run: ")]
    assert arith[0] == "run: arith async, CPU --colocate" and arith[2] == "PASS", arith
    assert f"{gpu_check.ARITH_ROLLOUTS_SMALL} iterations; pool 16384" in arith[1]
    # A peak per stage, the table with the commit, and no FAIL.
    assert all(s["peak_mib"] > 0 for s in report["stages"].values())
    table = (out / "table.md").read_text()
    assert table.startswith(f"Measured by `make gpu-check` at commit {report['commit']}")
    assert "0 FAIL, 0 not reached" in table and table.count("| peak host memory in use: ") == 4


def test_the_gpu_tests_run_gpu_critical_first_and_megatron_last():
    ids = gpu_pytest.gpu_test_ids()
    files = [i.split("::")[0].rsplit("/", 1)[-1] for i in ids]
    assert files[0] == "test_token_pool.py" and files[-1] == "test_megatron_model.py", ids
    assert ids[1].startswith("tests/unit/engine/test_engine_gpu.py::test_release_gives_the_weights")
    assert files[2:5] == ["test_cuda_ipc.py"] * 3
    assert all("fp8" in i for i in ids[5:7]), ids
    contract = gpu_pytest.gpu_test_ids(contract=True)
    assert contract and all("/contract/" in i for i in contract)


def _pytest_with_the_plugin(tmp_path: Path, args: list[str], jsonl: Path) -> subprocess.Popen:
    with (tmp_path / "pytest.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_pytest",
             "--rootdir", str(tmp_path), *args],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "bench"),
                 gpu_pytest.JSONL: str(jsonl)},
        )  # fmt: skip


def test_the_plugin_keeps_the_given_order_and_a_killed_pytest_keeps_its_lines(tmp_path):
    # A conftest that sorts as tests/conftest.py does (a FIRST file to the front).
    (tmp_path / "conftest.py").write_text(
        "def pytest_collection_modifyitems(items):\n"
        "    items.sort(key=lambda item: item.path.name != 'test_b.py')\n"
    )
    (tmp_path / "test_a.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n"
    )
    (tmp_path / "test_b.py").write_text("def test_last():\n    assert 3 == 4\n")
    jsonl = tmp_path / "tests.jsonl"
    order = ["test_a.py::test_fast", "test_a.py::test_slow", "test_b.py::test_last"]
    proc = _pytest_with_the_plugin(tmp_path, order, jsonl)
    try:
        deadline = time.monotonic() + 120
        while '"start", "id": "test_a.py::test_slow"' not in (
            jsonl.read_text() if jsonl.exists() else ""
        ):
            alive = proc.poll() is None and time.monotonic() < deadline
            assert alive, (tmp_path / "pytest.log").read_text()
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL in the middle of test_slow: no handler runs
        proc.wait()
    events = gpu_rows.read_events(jsonl)
    assert events[0] == {"event": "collected", "ids": order}
    stage = {"rc": -9, "timed_out": True, "tail": []}
    rows = gpu_rows.test_rows(jsonl, stage, [])
    assert [(r[0], r[3]) for r in rows] == [
        ("test test_a::test_fast", "PASS"),
        ("test test_a::test_slow", "not reached"),
        ("test test_b::test_last", "not reached"),
    ]
    assert "cut off" in rows[1][1] and "not started" in rows[2][1]
    # The same pytest left to finish: the failure's message.
    jsonl.unlink()
    assert _pytest_with_the_plugin(tmp_path, ["test_b.py"], jsonl).wait() == 1
    (row,) = gpu_rows.test_rows(jsonl, {"rc": 1, "timed_out": False, "tail": []}, [])
    assert row[3] == "FAIL" and "assert 3 == 4" in row[1]


def test_a_test_pytest_died_in_fails_and_a_line_cut_by_the_kill_is_left_out(tmp_path):
    jsonl = tmp_path / "gpu_tests.jsonl"
    events = [
        {"event": "collected", "ids": ["a.py::t", "a.py::u", "a.py::v"]},
        {"event": "start", "id": "a.py::t"},
    ]
    events += [
        {
            "event": "report",
            "id": "a.py::t",
            "when": when,
            "outcome": "passed",
            "seconds": 0.5,
            "message": "",
        }
        for when in ("setup", "call", "teardown")
    ]
    events += [{"event": "start", "id": "a.py::u"}]  # fmt: skip
    jsonl.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "rep')
    # a segfault in u: pytest exits -11 on its own, the stage in time
    rows = gpu_rows.test_rows(jsonl, {"rc": -11, "timed_out": False, "tail": []}, [])
    assert [r[3] for r in rows] == ["PASS", "FAIL", "not reached"]
    assert rows[0][1] == "passed in 1.5 s" and "pytest died while it ran (exit -11)" in rows[1][1]


def test_test_rows_without_a_report_none_collected_and_the_contract_tier(tmp_path):
    jsonl = tmp_path / "gpu_tests.jsonl"
    stage = {"rc": 1, "timed_out": False, "tail": ["ImportError: no module"]}
    assert gpu_rows.test_rows(jsonl, stage, ["a.py::t"])[0][3] == "FAIL"  # no report at all
    # a stage never started (out of budget): every expected test is not reached
    never = {"rc": None, "timed_out": True, "tail": ["not run"]}
    assert [r[3] for r in gpu_rows.test_rows(jsonl, never, ["a::t", "b::u"])] == [
        "not reached",
        "not reached",
    ]
    jsonl.write_text(json.dumps({"event": "collected", "ids": []}) + "\n")
    assert gpu_rows.test_rows(jsonl, {"rc": 5, "timed_out": False, "tail": []}, [])[0][3] == "FAIL"
    # the contract tier where sglang is not importable (its conftest's usage error): a skip
    absent = {"rc": 4, "timed_out": False, "tail": ["ERROR: ... sglang is not importable: ..."]}
    assert gpu_rows.test_rows(jsonl, absent, [], "contract")[0][3] == "skip"
    assert gpu_rows.test_rows(jsonl, {**absent, "rc": 1}, [], "contract")[0][3] == "FAIL"


def test_arith_rows_fail_without_85_percent_or_without_cuda_ipc():
    stage = {"rc": 0, "timed_out": False, "tail": []}

    def run(name, value, routes, tracebacks=0, iterations=40):
        return {"name": name, "value": value, "note": "" if value else "85% not reached",
                "extra": {"routes": routes, "best_eval": 0.9, "completions_per_s": 900.0,
                          "iterations": iterations, "rollouts": 40, "graph_captures": 12,
                          "tracebacks": tracebacks, "max_total_tokens": 16384}}  # fmt: skip

    ipc = ["tensor (same GPU: CUDA IPC)"]
    result = {"rows": [run("arith sync, GPU --colocate", 30.0, ipc),
                       run("arith async, GPU --colocate", 25.0, ["disk (fallback)"]),
                       run("arith sync, GPU --colocate", None, ipc),
                       run("arith async, GPU --colocate", 20.0, ipc, tracebacks=1)]}  # fmt: skip
    verdicts = [r[3] for r in gpu_rows.arith_rows(result, stage, "cuda")]
    assert verdicts == ["PASS", "FAIL", "FAIL", "FAIL"]
    # On the CPU no route is CUDA IPC: that alone fails nothing.
    assert gpu_rows.arith_rows(result, stage, "cpu")[1][3] == "PASS"
    assert gpu_rows.arith_rows(None, stage, "cuda")[0][3] == "FAIL"
    # --small: a run to its end passes without 85%; one cut short does not.
    small = {"rows": [run("a", None, []), run("b", None, [], iterations=3)]}
    assert [r[3] for r in gpu_rows.arith_rows(small, stage, "cpu", small=True)] == ["PASS", "FAIL"]


def test_bench_rows_a_goal_not_met_is_below_and_a_run_cut_short_fails():
    result = {
        "done": True,
        "rows": [
            {"section": "train", "name": "millstream torch, --bf16", "value": 900.0,
             "unit": "tokens/s", "ratio": 0.7, "base": "plain loop", "detail": "", "note": ""},
            {"section": "engine", "name": "millstream engine", "value": None, "unit": "",
             "ratio": None, "base": "", "detail": "", "note": "failed: engine exited 1"},
        ],
        "goals": [{"row": "millstream torch, --bf16", "target": ">= 0.85x", "met": False}],
    }  # fmt: skip
    stage = {"rc": 0, "timed_out": False, "tail": []}
    assert [r[3] for r in gpu_rows.bench_rows(result, stage, strict=False)] == ["BELOW", "FAIL"]
    assert [r[3] for r in gpu_rows.bench_rows(result, stage, strict=True)] == ["FAIL", "FAIL"]
    assert "failed: engine exited 1" in gpu_rows.bench_rows(result, stage, False)[1][1]
    cut = gpu_rows.bench_rows({**result, "done": False}, stage, False)
    assert cut[-1][3] == "FAIL" and "stopped after 2 rows" in cut[-1][1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie holds nothing; its reaper may be a PID 1 that never reaps


def test_a_stage_out_of_time_is_stopped_and_its_peak_sampled(tmp_path):
    # -S: no site packages to import, so the child is surely running Python's own SIGINT
    # handler when the signal comes, even on a loaded machine (a 2 s start-up once was not).
    # The child sets that handler itself: a test run started in the background by a shell
    # without job control inherits SIGINT ignored, and so would the child.
    code = (
        "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "print('working'); time.sleep(60)"
    )
    stage = gpu_stage.run_stage("slow", [sys.executable, "-S", "-c", code], 3.0, tmp_path, "cpu")
    assert stage["timed_out"] and stage["rc"] != 0
    assert stage["peak_mib"] > 0 and stage["tail"][-1] == "KeyboardInterrupt"  # SIGINT first
    assert (tmp_path / "slow.log").read_text().startswith("working\n")


def test_a_stage_ends_what_it_started_in_a_session_of_its_own(tmp_path):
    """As the arith run's run.sh: a grandchild in its own session (setsid) that ignores
    SIGINT, which a killpg of the stage's group misses; gone after the stage, cut off or not."""
    grandchild = "trap '' INT TERM; echo \\$\\$ > {pid}; exec sleep 600"
    pids = []
    try:
        for name, then in (("cut", "sleep 600"), ("done", "true")):
            pid_file = tmp_path / f"{name}.pid"
            script = (f"setsid bash -c \"{grandchild.format(pid=pid_file)}\" & "
                      f"while [ ! -s {pid_file} ]; do sleep 0.05; done; {then}")  # fmt: skip
            stage = gpu_stage.run_stage(name, ["bash", "-c", script], 2.0, tmp_path, "cpu",
                                        grace_s=1.0)  # fmt: skip
            pids.append(int(pid_file.read_text()))
            assert not _alive(pids[-1]), f"{name}: the setsid grandchild outlived its stage"
            assert stage["left_running"] >= 1 and stage["timed_out"] == (name == "cut")
        assert gpu_rows.stage_rows({"done": stage})[0][1] == "1 processes outlived it (ended)"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _no_environment(monkeypatch):
    monkeypatch.setattr(gpu_check, "environment", lambda: {"card": "CPU (no GPU)"})


def test_a_stage_that_fails_makes_the_check_exit_1_and_the_commit_is_passed_in(
    tmp_path, monkeypatch
):
    _no_environment(monkeypatch)
    monkeypatch.setattr(
        gpu_check, "stage_argv", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"]
    )
    out = tmp_path / "out"
    code = gpu_check.main(["--device", "cpu", "--stages", "bench", "--out", str(out),
                           "--work", str(tmp_path / "work"), "--commit", "abc1234"])  # fmt: skip
    assert code == 1
    report = json.loads((out / "gpu_check.json").read_text())
    verdicts = {row[0]: row[3] for row in report["rows"]}
    assert verdicts["stage bench"] == "FAIL" and verdicts["bench_gpu.py"] == "FAIL"
    assert report["commit"] == "abc1234"
    assert gpu_check.stage_env("bench", tmp_path, "abc1234")["MILLSTREAM_COMMIT"] == "abc1234"
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "work/bench.log" in tar.getnames()


def test_the_budget_counts_the_set_up_and_shares_what_is_left(tmp_path, monkeypatch):
    _no_environment(monkeypatch)
    clock = [1000.0]  # each stage below takes all of its limit
    limits = {}

    def all_of_its_time(name, argv, limit, *rest):
        limits[name] = limit
        clock[0] += limit
        return {"rc": 0, "seconds": limit, "timed_out": False, "peak_mib": 1.0, "tail": []}

    monkeypatch.setattr(gpu_check, "run_stage", all_of_its_time)
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setenv("MILLSTREAM_GPU_CHECK_T0", "980")  # scripts/gpu_check.sh, 20 s ago
    work = ["--work", str(tmp_path / "work"), "--commit", "x"]
    gpu_check.main(["--device", "cpu", "--small", "--out", str(tmp_path / "a"), *work])
    left = 420 - 20 - gpu_check.RESERVE_S
    want = sum(gpu_check.WANT_S.values())
    assert limits == pytest.approx({n: left * w / want for n, w in gpu_check.WANT_S.items()})
    # Set-up that took the window (the script started 410 s ago): no stage starts, every
    # GPU test is "not reached", and the check fails.
    limits.clear()
    monkeypatch.setenv("MILLSTREAM_GPU_CHECK_T0", str(clock[0] - 410))
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path / "b"), *work])
    assert code == 1 and limits == {}
    report = json.loads((tmp_path / "b" / "gpu_check.json").read_text())
    tests = [r for r in report["rows"] if r[0].startswith("test ")]
    assert len(tests) == len(gpu_pytest.gpu_test_ids()) + len(gpu_pytest.gpu_test_ids(True))
    assert {r[3] for r in tests} == {"not reached"}
    assert {f"stage {s}" for s in gpu_check.STAGES} <= {
        r[0] for r in report["rows"] if r[3] == "FAIL"
    }


def test_publish_writes_between_the_markers_once(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\nbefore\n\n{gpu_rows.DOCS_START}\nold\n{gpu_rows.DOCS_END}\n\nafter\n")
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
    assert "1 PASS, 1 BELOW a goal, 0 FAIL, 0 not reached" in text
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


def test_the_contract_stage_takes_bootstraps_sglang_only_for_the_python_it_was_made_for(tmp_path):
    # The GPU image's Python 3.12 beside a 3.11 venv: .venv/sglang's orjson fails to import
    # there (seen in the CPU rehearsal of the device's environment), so the tier must skip.
    venv = tmp_path / ".venv"
    (venv / "sglang").mkdir(parents=True)
    ours = "{}.{}".format(*sys.version_info[:2])
    (venv / "pyvenv.cfg").write_text(f"home = /x\nversion = {ours}.7\n")
    assert gpu_check.sglang_dir_for_this_python(venv)
    (venv / "pyvenv.cfg").write_text("home = /x\nversion = 3.1.7\n")
    assert not gpu_check.sglang_dir_for_this_python(venv)
    (venv / "pyvenv.cfg").unlink()
    assert not gpu_check.sglang_dir_for_this_python(venv)
