"""`make gpu-check`: every GPU path of millstream once, on one NVIDIA GPU, in one table, within
one lent machine's window.

    python bench/gpu_check.py [--device cuda] [--budget-s 420] [--stages tests,contract,bench,arith]
        [--out runs/gpu-check] [--work DIR] [--commit SHA] [--docs docs/benchmarks.md | --no-docs]
        [--arith-modes async] [--strict]
    python bench/gpu_check.py --device cpu --small --no-docs   (the same stages, the plumbing)
    python bench/gpu_check.py --publish runs/gpu-check/gpu_check.json   (a fetched table -> docs)

scripts/gpu_check.sh sets up the machine (the carried `.gpu/` bundle on a lent GPU machine,
else the Python it finds) and runs this. Stages, each a subprocess under its own limit
(bench/gpu_stage.py: everything it started ended after it, in time or not):

  tests     the GPU-marked tests (bench/gpu_pytest.py: GPU-critical first, Megatron last, each
            reported as it runs; a test the time ran out before is a row "not reached")
  contract  the contract tier's GPU-marked tests (tests/contract/, as make test runs it:
            SGLang reads the trainer's CUDA IPC payloads); "skip" where sglang is not
            importable (the GPU machine's image has none)
  bench     bench/bench_gpu.py --only train,engine,sync, sized to fit: the --bf16 train step
            against a plain bf16 loop, the engine with and without CUDA graphs against HF
            generate at concurrency 1 and 64, the FP8 engine, the colocated weight update
            (CUDA IPC) in ms per GB, the decode step over a small and a large pool
  arith     bench/bench_gpu.py --only run --no-cpu-run: examples/arith/run.sh with --colocate
            --bf16, the engine's pool capped, --arith-rollouts, in --arith-modes (async: two
            modes do not fit one window), to 85% greedy accuracy

The budget: a lent machine gives about 15 device minutes in all, a start costs 1-2 and one
command 10 at most; the check must leave a rerun room. So the whole command, set-up included
(scripts/gpu_check.sh sets MILLSTREAM_GPU_CHECK_T0 when it starts), ends within --budget-s
(420 s). Each stage gets a share of what is left (WANT_S's proportions, minus RESERVE_S for
the last stage's grace and the table), so time a stage does not use goes to the later ones,
and a stage that would get less than MIN_S is not run (FAIL). `--device cpu --small` runs the
same stages on the tiny sizes (GPU tests skip; the arith run is judged on running to its end)
and writes the same files.

Beside every stage the device's memory in use is sampled (nvidia-smi every 0.2 s; on the CPU
the host's): the peak of each stage is a row. The rows and verdicts: bench/gpu_rows.py. The
exit status is 1 when a row FAILs.

--out gets at most three files (a lent machine returns 8): gpu_check.json (the report),
table.md, logs.tar.gz (every stage's log, the tests' JSON lines, bench_gpu.py's JSON and the
arith run's logs, all from --work, runs/gpu-check.work), written again after every
stage, so a run cut short still returns what it did. The commit: --commit, else git's, else
$MILLSTREAM_COMMIT (scripts/gpu_check.sh reads the bundle's .gpu/commit: no .git travels),
else "unknown". The table goes to stdout and, on a GPU, into docs/benchmarks.md between its
gpu-check markers (--docs); from a fetched JSON, `--publish PATH` writes it there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "bench"))

import gpu_rows  # noqa: E402
from gpu_bench_run import STOP_S  # noqa: E402
from gpu_pytest import JSONL, gpu_test_ids  # noqa: E402
from gpu_stage import GRACE_S, run_stage, say  # noqa: E402

STAGES = ("tests", "contract", "bench", "arith")
# The stages' shares of the time left (seconds each wants with set-up at ~30 s of 420).
WANT_S = {"tests": 130, "contract": 20, "bench": 110, "arith": 100}
RESERVE_S = GRACE_S + 10  # after the last stage: its SIGINT grace, then the table and archive
MIN_S = 15  # a stage given less is not started
SGLANG_DIR = REPO_ROOT / ".venv" / "sglang"  # the contract tier's SGLang (scripts/bootstrap.sh)
BENCH_CUDA = ["--batch", "32", "--seq-len", "512", "--micro-batch-size", "8", "--repeats", "1",
              "--hf-batch", "64", "--prompt-tokens", "32", "--new-tokens", "32",
              "--concurrency", "1,64", "--rounds", "1", "--syncs", "3",
              "--mem-fraction-static", "0.5"]  # fmt: skip
# 85% comes at about 20 rollouts on the CPU (make run's curve); --small only runs the path.
ARITH_ROLLOUTS, ARITH_ROLLOUTS_SMALL = 40, 6
ARITH_MAX_TOTAL_TOKENS = 16384  # bench/gpu_bench_run.py says why
OUT_FILES = ("gpu_check.json", "table.md", "logs.tar.gz")
# The arith run's checkpoints, Redis files, span traces and plots: data, not logs (tens of MB
# after 40 rollouts).
ARCHIVE_SKIP = ("ckpt", "redis", "traces", "plots")
ARCHIVE_MAX_BYTES = 20 * 2**20  # a file larger than this is left out of the archive


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
                              timeout=90, check=True)  # fmt: skip
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


def commit(given: str | None) -> str:
    """--commit, else bench_gpu.py's (git, else $MILLSTREAM_COMMIT, else "unknown")."""
    if given:
        return given
    from bench_gpu import git_commit

    return git_commit()


def sglang_dir_for_this_python(venv: Path = SGLANG_DIR.parent) -> bool:
    """Whether bootstrap's .venv/sglang is there and was installed for this Python: its
    compiled dependencies (orjson) are built for the venv's minor version, and another Python
    (the GPU image's 3.12 beside a 3.11 venv) fails to import them, where it should skip."""
    try:
        cfg = (venv / "pyvenv.cfg").read_text()
    except OSError:
        return False
    version = dict(line.split(" = ", 1) for line in cfg.splitlines() if " = " in line)
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    made_for = ".".join(version.get("version", "").split(".")[:2])
    return (venv / "sglang").is_dir() and made_for == ours


def stage_env(name: str, work: Path, commit: str) -> dict[str, str]:
    """Every stage: the commit, for bench_gpu.py where there is no git. The test stages:
    gpu_pytest.py's plugin on the path and its file. The contract stage: as make test runs
    tests/contract (MILLSTREAM_CONTRACT=1, .venv/sglang first on the path where bootstrap
    made it for this Python)."""
    env = {**os.environ, "MILLSTREAM_COMMIT": commit}
    if name in ("tests", "contract"):
        paths = [str(REPO_ROOT / "bench")]
        if name == "contract":
            env["MILLSTREAM_CONTRACT"] = "1"
            if sglang_dir_for_this_python():
                paths.insert(0, str(SGLANG_DIR))
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
        env[JSONL] = str(work / f"gpu_{name}.jsonl")
    return env


def stage_argv(name: str, args: argparse.Namespace, work: Path, limit_s: float) -> list[str]:
    py = sys.executable
    if name in ("tests", "contract"):
        return [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                "-p", "no:randomly", "-p", "gpu_pytest", "-W", "default",
                "--timeout", str(int(min(120, limit_s))), *args.expected[name]]  # fmt: skip
    bench = [py, "bench/bench_gpu.py", "--device", args.device]
    sizes = ["--small"] if args.small else (BENCH_CUDA if args.device == "cuda" else [])
    if name == "bench":
        return [*bench, *sizes, "--only", "train,engine,sync", "--json", str(work / "bench.json")]
    rollouts = args.arith_rollouts or (ARITH_ROLLOUTS_SMALL if args.small else ARITH_ROLLOUTS)
    # bench_gpu.py's start (15 s), then each run's time and its stop if it runs out of it
    per_run = max(10, (limit_s - 15) / len(args.arith_modes.split(",")) - STOP_S)
    return [*bench, *sizes, "--only", "run", "--no-cpu-run", "--arith-modes", args.arith_modes,
            "--arith-rollouts", str(rollouts), "--arith-max-total-tokens",
            str(ARITH_MAX_TOTAL_TOKENS), "--run-timeout", f"{per_run:.0f}",
            "--run-dir", str(work / "arith"), "--json", str(work / "arith.json")]  # fmt: skip


def load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def archive(work: Path, path: Path) -> None:
    """Every log of --work in one tar.gz (temp, then renamed: a kill never leaves half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(work.rglob("*")):
            rel = f.relative_to(work)
            kept = f.is_file() and not f.is_symlink() and not set(rel.parts) & set(ARCHIVE_SKIP)
            if kept and f.stat().st_size <= ARCHIVE_MAX_BYTES:
                tar.add(f, arcname=str(Path(work.name) / rel))
    os.replace(tmp, path)


def rows_of(args: argparse.Namespace, env: dict, stages: dict[str, dict], work: Path) -> list:
    software = ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "cuda", "transformers",
                                                   "driver") if env.get(k))  # fmt: skip
    rows: list[gpu_rows.Row] = [("environment", f"{env.get('card')}: {software}", "", "info")]
    rows.append(("set-up", f"{args.setup_s:.0f} s before the first stage (scripts/gpu_check.sh "
                 "and the environment)", "", "info"))  # fmt: skip
    for name in ("tests", "contract"):
        rows += gpu_rows.test_rows(work / f"gpu_{name}.jsonl", stages.get(name),
                                   args.expected.get(name, []), name)  # fmt: skip
    rows += gpu_rows.bench_rows(load(work / "bench.json"), stages.get("bench"), args.strict)
    rows += gpu_rows.arith_rows(load(work / "arith.json"), stages.get("arith"), args.device,
                                args.small)  # fmt: skip
    return rows + gpu_rows.stage_rows(stages) + gpu_rows.memory_rows(stages, args.device)


def write_report(args: argparse.Namespace, env: dict, stages: dict, complete: bool) -> dict:
    """gpu_check.json, table.md and logs.tar.gz into --out (module docstring)."""
    report = {"commit": args.commit, "date": time.strftime("%Y-%m-%d"), "environment": env,
              "device": args.device, "budget_s": args.budget_s, "stages": stages,
              "rows": rows_of(args, env, stages, args.work), "complete": complete,
              "seconds": time.time() - args.t0, "work": str(args.work)}  # fmt: skip
    archive(args.work, args.out / "logs.tar.gz")
    for name, text in (("table.md", gpu_rows.docs_section(report)),
                       ("gpu_check.json", json.dumps(report, indent=1))):  # fmt: skip
        tmp = args.out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, args.out / name)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="bench_gpu.py's tiny sizes (plumbing)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma list of " + ", ".join(STAGES))
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="the whole command, set-up included, ends within this")  # fmt: skip
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu-check")
    p.add_argument("--work", type=Path, default=REPO_ROOT / "runs" / "gpu-check.work",
                   help="the logs, before they are archived into --out")  # fmt: skip
    p.add_argument("--commit", default=None, help="the commit measured (default: git's)")
    p.add_argument("--docs", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--strict", action="store_true", help="a goal not met FAILs too")
    small = f"default {ARITH_ROLLOUTS}, {ARITH_ROLLOUTS_SMALL} with --small"
    p.add_argument("--arith-rollouts", type=int, default=0, help=small)
    p.add_argument("--arith-modes", default="async", help="sync, async or both (sync,async)")
    p.add_argument("--publish", type=Path, metavar="JSON", help="write this report into --docs")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    if unknown := set(args.stages) - set(STAGES):
        p.error(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(STAGES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.publish:
        gpu_rows.publish(json.loads(args.publish.read_text()), args.docs)
        say(f"wrote the table into {args.docs}")
        return 0
    # scripts/gpu_check.sh's start: the budget holds the set-up too
    try:
        args.t0 = float(os.environ["MILLSTREAM_GPU_CHECK_T0"])
    except (KeyError, ValueError):
        args.t0 = time.time()
    args.out = args.out.resolve()
    args.work = args.work.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    for name in OUT_FILES:  # a file of an earlier run must not pass for this one's
        (args.out / name).unlink(missing_ok=True)
    env = environment()
    if args.device == "cuda" and "capability" not in env:
        say(f"--device cuda: torch sees no GPU here ({env}); --device cpu runs the plumbing")
        return 2
    args.commit = commit(args.commit)
    args.expected = {name: gpu_test_ids(contract=name == "contract") for name in STAGES[:2]}
    args.setup_s = time.time() - args.t0
    say(f"{env.get('card')}; torch {env.get('torch')}; commit {args.commit}; budget "
        f"{args.budget_s:.0f} s, {args.setup_s:.0f} s spent on set-up; out {args.out}")  # fmt: skip
    stages: dict[str, dict] = {}
    todo = [s for s in STAGES if s in args.stages]
    for i, name in enumerate(todo):
        left = args.budget_s - (time.time() - args.t0) - RESERVE_S
        limit = left * WANT_S[name] / sum(WANT_S[n] for n in todo[i:])
        if name in ("tests", "contract") and not args.expected[name]:
            continue  # no GPU-marked test in that tier: nothing to run (pytest would run all)
        if limit < MIN_S:
            stages[name] = {"rc": None, "seconds": 0, "timed_out": True, "peak_mib": None,
                            "tail": [f"not run: {left:.0f} s of the budget left"]}  # fmt: skip
        else:
            argv = stage_argv(name, args, args.work, limit)
            stages[name] = run_stage(name, argv, limit, args.work, args.device,
                                     stage_env(name, args.work, args.commit))  # fmt: skip
        write_report(args, env, stages, complete=False)
    report = write_report(args, env, stages, complete=True)
    print(gpu_rows.docs_section(report))
    if args.device == "cuda" and not args.no_docs:
        gpu_rows.publish(report, args.docs)
        say(f"wrote the table into {args.docs}")
    failed = [r[0] for r in report["rows"] if r[3] == "FAIL"]
    if failed:
        say(f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
