"""`make gpu-check`: every GPU path of millstream once, on one NVIDIA GPU, in one table.

    python bench/gpu_check.py [--device cuda] [--budget-s 430] [--stages tests,bench,arith]
        [--out runs/gpu-check] [--docs docs/benchmarks.md | --no-docs] [--strict]
    python bench/gpu_check.py --device cpu --small --stages tests,bench --no-docs   (plumbing)
    python bench/gpu_check.py --publish runs/gpu-check/gpu_check.json   (a fetched table -> docs)

scripts/gpu_check.sh sets up the machine (the carried `.gpu/` bundle on a lent GPU machine,
else the Python it finds) and runs this. Stages, each a subprocess under its own limit inside
one budget (what is left of --budget-s; a stage that runs out is stopped and FAILs):

  tests   the GPU-marked tests (`pytest -m gpu` over the files that carry the mark, listed in
          docs/testing.md): the CUDA IPC route between two processes, colocation's turns on
          the device, the engine's memory release, CUDA graph decoding against eager, ...
  contract  the contract tier's GPU-marked tests (tests/contract/, as make test runs it: SGLang
          reads the trainer's CUDA IPC payloads); "skip" where sglang is not importable
  bench   bench/bench_gpu.py --only train,engine,sync, sized to fit: the --bf16 train step
          against a plain bf16 loop, the engine with and without CUDA graphs against HF
          generate at concurrency 1 and 64, the FP8 engine, the colocated weight update
          (CUDA IPC) in ms per GB, pause to continue
  arith   bench/bench_gpu.py --only run --no-cpu-run: examples/arith/run.sh with --colocate
          --bf16, sync then async, to 85% greedy accuracy

Beside every stage the device's memory in use is sampled (nvidia-smi every 0.2 s; on the CPU
the host's, from /proc/meminfo): the peak of each phase is a row.

Verdicts: PASS; BELOW, a speed goal of bench_gpu.py not met (measured and reported; a failure
only with --strict); FAIL, a test failed, a stage crashed or ran out of time, a row was not
measured, or an arith run did not reach 85% (or, on a GPU, did not sync over CUDA IPC); skip,
a GPU test where torch sees no GPU (--device cpu). The exit status is 1 when a row FAILs.

--out gets gpu_check.json, table.md and every stage's log. The table goes to stdout and, with
the commit and the card, into docs/benchmarks.md between its gpu-check markers (--docs; not
with --device cpu). On a lent machine the docs come back through the fetched JSON:
`--publish PATH` writes them from it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
STAGES = ("tests", "contract", "bench", "arith")
# Seconds each stage wants at most (the budget's remainder caps it).
WANT_S = {"tests": 120, "contract": 60, "bench": 170, "arith": 160}
SGLANG_DIR = REPO_ROOT / ".venv" / "sglang"  # the contract tier's SGLang (scripts/bootstrap.sh)
BENCH_CUDA = ["--batch", "32", "--seq-len", "512", "--micro-batch-size", "8", "--repeats", "1",
              "--hf-batch", "64", "--prompt-tokens", "32", "--new-tokens", "32",
              "--concurrency", "1,64", "--rounds", "1", "--syncs", "3",
              "--mem-fraction-static", "0.5"]  # fmt: skip
ARITH_ROLLOUTS = 40  # 85% comes at about 20 on the CPU (make run's curve)
DOCS_START, DOCS_END = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"


def say(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class MemorySampler:
    """The peak of the device's memory in use (MiB) while a stage runs: nvidia-smi's
    memory.used of the first visible GPU, or on the CPU the host's MemTotal - MemAvailable."""

    def __init__(self, device: str, period_s: float = 0.2):
        self.device, self.period_s = device, period_s
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._smi = shutil.which("nvidia-smi") if device == "cuda" else None

    def read_mib(self) -> float | None:
        if self.device == "cuda":
            if self._smi is None:
                return None
            index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
            try:
                out = subprocess.run(
                    [self._smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                     "-i", index], capture_output=True, text=True, timeout=5, check=True,
                ).stdout  # fmt: skip
                return float(out.split()[0])
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return None
        info = dict(
            (line.split(":")[0], float(line.split()[1]))
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith(("MemTotal:", "MemAvailable:"))
        )
        return (info["MemTotal"] - info["MemAvailable"]) / 1024

    def __enter__(self) -> MemorySampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            mib = self.read_mib()
            if mib is not None:
                self.peak = mib if self.peak is None else max(self.peak, mib)
            self._stop.wait(self.period_s)


def run_stage(
    name: str, argv: list[str], limit_s: float, out: Path, device: str,
    env: dict[str, str] | None = None,
) -> dict:  # fmt: skip
    """`argv` under `limit_s` (SIGINT, then SIGKILL 20 s later), its output in out/NAME.log."""
    log = out / f"{name}.log"
    say(f"=== {name} (limit {limit_s:.0f} s): {' '.join(argv[1:4])} ...")
    start = time.monotonic()
    with log.open("w") as sink, MemorySampler(device) as memory:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)  # fmt: skip
        timed_out = False
        try:
            rc = proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGINT)
            try:
                rc = proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    seconds = time.monotonic() - start
    say(f"{name}: exit {rc} in {seconds:.0f} s{' (out of time)' if timed_out else ''}")
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {"rc": rc, "seconds": round(seconds, 1), "timed_out": timed_out,
            "peak_mib": memory.peak, "tail": tail}  # fmt: skip


def gpu_test_files(contract: bool = False) -> list[str]:
    """The test files that carry the gpu mark (collecting only them keeps the stage short and
    free of the imports other tiers need): the contract tier's (tests/contract/, run with
    SGLang's package on the path) or the others."""
    files = sorted((REPO_ROOT / "tests").rglob("test_*.py"))
    return [
        str(f.relative_to(REPO_ROOT))
        for f in files
        if "mark.gpu" in f.read_text() and (f.parent.name == "contract") == contract
    ]


def stage_env(name: str) -> dict[str, str] | None:
    """The contract stage's environment: as make test runs tests/contract (MILLSTREAM_CONTRACT=1,
    .venv/sglang first on the path where bootstrap made it; else an sglang installed here)."""
    if name != "contract":
        return None
    env = {**os.environ, "MILLSTREAM_CONTRACT": "1"}
    if SGLANG_DIR.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(SGLANG_DIR), env.get("PYTHONPATH", "")) if p
        )
    return env


def stage_argv(name: str, args: argparse.Namespace, out: Path) -> list[str]:
    py = sys.executable
    if name in ("tests", "contract"):
        return [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-W", "default",
                "--timeout", "120", "--junitxml", str(out / f"gpu_{name}.xml"),
                *gpu_test_files(contract=name == "contract")]  # fmt: skip
    bench = [py, "bench/bench_gpu.py", "--device", args.device]
    sizes = ["--small"] if args.small else (BENCH_CUDA if args.device == "cuda" else [])
    if name == "bench":
        return [*bench, *sizes, "--only", "train,engine,sync", "--json", str(out / "bench.json")]
    per_run = max(30, (args.limits["arith"] - 10) // 2)
    return [*bench, *sizes, "--only", "run", "--no-cpu-run", "--arith-rollouts",
            str(args.arith_rollouts), "--run-timeout", str(per_run),
            "--json", str(out / "arith.json")]  # fmt: skip


def environment() -> dict[str, Any]:
    """The card and the software, from a child (this process never creates a CUDA context)."""
    code = (
        "import json, platform, torch, transformers\n"
        "d = {'python': platform.python_version(), 'torch': torch.__version__,"
        " 'cuda': torch.version.cuda, 'transformers': transformers.__version__}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d |= {'card': p.name, 'capability': '.'.join(map(str, torch.cuda.get_device_capability(0))),"
        " 'memory_gib': round(p.total_memory / 2**30, 1)}\n"
        "print(json.dumps(d))\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True)  # fmt: skip
        env = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as err:
        env = {"error": str(err)[-300:]}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False)  # fmt: skip
        env["driver"] = q.stdout.strip().splitlines()[0] if q.stdout.strip() else None
    env.setdefault("card", "CPU (no GPU)")
    return env


def commit() -> str:
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from bench_gpu import git_commit

    return git_commit()


# -- the table --------------------------------------------------------------------------------

Row = tuple[str, str, str, str]  # check, measured, goal, verdict


def test_rows(out: Path, stage: dict | None, name: str = "tests") -> list[Row]:
    """A row per GPU-marked test of the stage `name` (its junit report)."""
    xml = out / f"gpu_{name}.xml"
    label = "GPU-marked tests" if name == "tests" else "GPU-marked contract tests"
    if stage is None:
        return []
    if name == "contract" and stage["rc"] == 4 and "sglang is not importable" in str(stage):
        return [(label, "not run: sglang is not importable here (scripts/bootstrap.sh puts the "
                 "contract tier's in .venv/sglang)", "pass", "skip")]  # fmt: skip
    if not xml.is_file():
        return [(label, f"no report: {' | '.join(stage['tail'])}", "pass", "FAIL")]
    rows: list[Row] = []
    cases = list(ET.parse(xml).getroot().iter("testcase"))
    if not cases:
        return [(label, "none collected", "every test in docs/testing.md", "FAIL")]
    for case in cases:
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        seconds = float(case.get("time") or 0)
        if case.find("failure") is not None or case.find("error") is not None:
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            message = (bad.get("message") or "").splitlines()[0][:200] if bad is not None else ""
            rows.append((f"test {name}", f"failed in {seconds:.1f} s: {message}", "pass", "FAIL"))
        elif case.find("skipped") is not None:
            why = (case.find("skipped").get("message") or "")[:120]  # type: ignore[union-attr]
            rows.append((f"test {name}", f"skipped: {why}", "pass", "skip"))
        else:
            rows.append((f"test {name}", f"passed in {seconds:.1f} s", "pass", "PASS"))
    if stage["timed_out"] or (stage["rc"] not in (0, 5) and not any(r[3] == "FAIL" for r in rows)):
        rows.append((label, f"exit {stage['rc']}: {' | '.join(stage['tail'])}", "exit 0",
                     "FAIL"))  # fmt: skip
    return rows


def bench_rows(result: dict | None, stage: dict | None, strict: bool) -> list[Row]:
    if stage is None:
        return []
    if result is None:
        return [("bench_gpu.py", f"no result: {' | '.join(stage['tail'])}", "rows", "FAIL")]
    goals = {g["row"]: g for g in result.get("goals", [])}
    rows: list[Row] = []
    for r in result["rows"]:
        if r["value"] is None:
            rows.append((f"{r['section']}: {r['name']}", r["note"] or "not measured", "measured",
                         "FAIL"))  # fmt: skip
            continue
        ratio = f"; {r['ratio']:.3g}x {r['base']}" if r.get("ratio") is not None else ""
        detail = "; ".join(x for x in (r.get("detail"), r.get("note")) if x)
        measured = f"{r['value']:.4g} {r['unit']}{ratio}" + (f"; {detail}" if detail else "")
        g = goals.get(r["name"])
        verdict = "PASS" if g is None or g["met"] else ("FAIL" if strict else "BELOW")
        rows.append((f"{r['section']}: {r['name']}", measured, g["target"] if g else "", verdict))
    return rows


def arith_rows(result: dict | None, stage: dict | None, device: str) -> list[Row]:
    if stage is None:
        return []
    if result is None:
        return [("arith --colocate --bf16", f"no result: {' | '.join(stage['tail'])}", "85%",
                 "FAIL")]  # fmt: skip
    rows: list[Row] = []
    for r in result["rows"]:
        e = r.get("extra") or {}
        if r["value"] is None:
            rows.append((r["name"], r["note"] or "not measured", "85%", "FAIL"))
            continue
        routes = "; ".join(e.get("routes", [])) or "no transport line"
        ipc = device != "cuda" or "CUDA IPC" in routes
        measured = (f"85% at {r['value']:.1f} s (best {e.get('best_eval')}); "
                    f"{e.get('completions_per_s', 0):.0f} completions/s; {e.get('iterations')} "
                    f"iterations; transport: {routes}; graph captures {e.get('graph_captures')}; "
                    f"tracebacks {e.get('tracebacks')}")  # fmt: skip
        ok = ipc and not e.get("tracebacks")
        rows.append((f"run: {r['name']} --bf16", measured, "85%; CUDA IPC sync",
                     "PASS" if ok else "FAIL"))  # fmt: skip
    return rows


def memory_rows(stages: dict[str, dict], device: str) -> list[Row]:
    where = "device" if device == "cuda" else "host"
    return [
        (f"peak {where} memory in use: {name}",
         "n/a" if s["peak_mib"] is None else f"{s['peak_mib'] / 1024:.2f} GiB", "", "info")
        for name, s in stages.items()
    ]  # fmt: skip


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def table(rows: list[Row]) -> str:
    lines = ["| check | measured | goal | verdict |", "| --- | --- | --- | --- |"]
    lines += [f"| {c} | {m.replace('|', '/')} | {g} | {v} |" for c, m, g, v in rows]
    return "\n".join(lines)


def docs_section(report: dict) -> str:
    env = report["environment"]
    where = (f"{env.get('card')} ({env.get('memory_gib', '?')} GiB, compute capability "
             f"{env.get('capability', '?')}, driver {env.get('driver', '?')}); Python "
             f"{env.get('python')}, torch {env.get('torch')} (CUDA {env.get('cuda')}), "
             f"transformers {env.get('transformers')}")  # fmt: skip
    counts = {v: sum(1 for r in report["rows"] if r[3] == v) for v in ("PASS", "BELOW", "FAIL")}
    return (
        f"Measured by `make gpu-check` at commit {report['commit']} on {where}, "
        f"{report['date']}, {report['seconds']:.0f} s in all: {counts['PASS']} PASS, "
        f"{counts['BELOW']} BELOW a goal, {counts['FAIL']} FAIL.\n\n{table(report['rows'])}\n"
    )


def publish(report: dict, docs: Path) -> None:
    text = docs.read_text()
    if DOCS_START not in text or DOCS_END not in text:
        raise SystemExit(f"{docs}: no {DOCS_START} ... {DOCS_END} markers to write between")
    head, rest = text.split(DOCS_START, 1)
    _, tail = rest.split(DOCS_END, 1)
    docs.write_text(f"{head}{DOCS_START}\n{docs_section(report)}{DOCS_END}{tail}")
    say(f"wrote the table into {docs}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="bench_gpu.py's tiny sizes (plumbing)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ", ".join(STAGES))
    p.add_argument("--budget-s", type=float, default=430.0, help="all stages together")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu-check")
    p.add_argument("--docs", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--strict", action="store_true", help="a goal not met FAILs too")
    p.add_argument("--arith-rollouts", type=int, default=ARITH_ROLLOUTS)
    p.add_argument("--publish", type=Path, metavar="JSON", help="write this report into --docs")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    if unknown := set(args.stages) - set(STAGES):
        p.error(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(STAGES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.publish:
        publish(json.loads(args.publish.read_text()), args.docs)
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    env = environment()
    if args.device == "cuda" and "capability" not in env:
        say(f"--device cuda: torch sees no GPU here ({env}); --device cpu runs the plumbing")
        return 2
    say(f"{env.get('card')}; torch {env.get('torch')}; budget {args.budget_s:.0f} s; out {out}")
    stages: dict[str, dict] = {}
    args.limits = {}
    for name in (s for s in STAGES if s in args.stages):
        left = args.budget_s - (time.monotonic() - start)
        args.limits[name] = min(WANT_S[name], left)
        if args.limits[name] < 20:
            stages[name] = {"rc": None, "seconds": 0, "timed_out": True, "peak_mib": None,
                            "tail": [f"not run: {left:.0f} s of the budget left"]}  # fmt: skip
            continue
        stages[name] = run_stage(name, stage_argv(name, args, out), args.limits[name], out,
                                 args.device, stage_env(name))  # fmt: skip
    software = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "cuda", "transformers",
                                                   "driver") if env.get(k))  # fmt: skip
    rows: list[Row] = [("environment", f"{env.get('card')}: {software}", "", "info")]
    rows += test_rows(out, stages.get("tests"))
    rows += test_rows(out, stages.get("contract"), "contract")
    rows += bench_rows(load(out / "bench.json"), stages.get("bench"), args.strict)
    rows += arith_rows(load(out / "arith.json"), stages.get("arith"), args.device)
    for name, s in stages.items():
        if s["timed_out"] or (name not in ("tests", "contract") and s["rc"] != 0):
            rows.append((f"stage {name}", f"exit {s['rc']} after {s['seconds']:.0f} s"
                         f"{' (out of time)' if s['timed_out'] else ''}: {' | '.join(s['tail'])}",
                         "exit 0 in time", "FAIL"))  # fmt: skip
    rows += memory_rows(stages, args.device)
    report = {"commit": commit(), "date": time.strftime("%Y-%m-%d"), "environment": env,
              "device": args.device, "stages": stages, "rows": rows,
              "seconds": time.monotonic() - start}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "table.md").write_text(docs_section(report))
    print(docs_section(report))
    if args.device == "cuda" and not args.no_docs:
        publish(report, args.docs)
    failed = [r[0] for r in rows if r[3] == "FAIL"]
    if failed:
        say(f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
