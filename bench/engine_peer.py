"""`bench/bench_engine.py --peer sglang`: millstream's engine beside a real SGLang server, on the
same model, the same load and the same compute threads, in one run.

    .venv/bin/python bench/bench_engine.py --peer sglang --rounds 8
    .venv/bin/python bench/bench_engine.py --peer sglang --smoke      # ~2 min: plumbing only

The peer. SGLang 0.5.23 from its own venv (scripts/bootstrap_sglang.sh; $MILLSTREAM_SGLANG_PYTHON
or --sglang-python names its Python), started by the live tier's harness
(tests/sglang_live/server.py `LiveSglang`): the command line millstream's launcher builds for a
Miles launch script's CPU flags (fp32, torch_native attention, pytorch sampling, no CUDA graphs,
--sleep-on-idle, a KV pool of --max-total-tokens 65536), and the environment its CPU engine needs.
millstream's engine (`millstream engine`, fp32 on the CPU) gets the same pool size and both the
same --max-running-requests. The model: a random Qwen2 built from a config (the tests'
byte-level tokenizer; hidden 256, 4 layers, 4 heads, 2 KV heads, 8k context by default: 2.4M
parameters, 17x the arith model's 140k), the same directory for both.

Threads. millstream's engine takes `--num-threads N` (torch's intra-op pool; inter-op 1).
SGLang's CPU engine has no flag for it: its scheduler binds OpenMP threads to cores in
`srt/distributed/bootstrap.py` `_init_cpu_threads_env` (cores from `numa_utils
.init_threads_binding`, or SGLANG_CPU_OMP_THREADS_BIND) only when sgl_kernel's Intel AMX
backend is there (`cpu_has_amx_support()`: `torch.ops.sgl_kernel.convert_weight_packed`);
with the test tree's kernel stand-in it logs "init_cpu_threads_env ... is disabled" and never
calls torch.set_num_threads on the CPU (model_runner.py calls it only when the device is not
the CPU), so its pool is torch's default: OMP_NUM_THREADS. Both processes trees are given the
same pool environment (common/threads.py `pool_env(N)`: OMP/MKL/OPENBLAS_NUM_THREADS=N and
GOMP_SPINCOUNT), and the bench checks what they did: per row, the threads of each engine's
model process that compute (millstream's engine but its HTTP thread, SGLang's
`sglang::scheduler`) and were busy for a fifth of the row or more, and the cores each engine's
whole process tree kept busy (SGLang's is three processes: HTTP and tokenizer, scheduler,
detokenizer).

Rows, each on both engines in every round (prompts of --prompt-tokens random bytes, new ones
each round and the same for both engines, so neither finds the other round's prompts in its
prefix cache; every request with ignore_eos and a fixed max_new_tokens, temperature 1):
  c1, c16, c64  max(8, 2c) requests of --new-tokens from c clients in a closed loop: output
                tokens/s over the row, and each request's latency (send to answer), p50/p99;
  grpo n=8      --burst-prompts requests sent at once, each with n=8 samples and
                return_logprob (a GRPO group per request): tokens/s, a request's latency is
                until its 8 samples are back;
  grpo 512 x 1  the same rows as --burst-prompts x 8 single requests at once, the shape of a
                Miles rollout, which sends each sample of a group as a request of its own.
Before comparing, the bench checks that both engines reported the same completion tokens for
every row of every round (requests x new tokens) and a log-prob for every token.

Pairing. Both servers stay up side by side (an idle one waits: millstream's engine on its
queue, SGLang asleep with --sleep-on-idle); each round runs every row on one and then the
other, the order swapped every other round; one small warm-up round on each is discarded.
Every ratio is millstream / SGLang in the same round, and the table gives its median over the
rounds (tokens/s: above 1 millstream is faster; latency: below 1 millstream is faster) beside
each engine's median value. This machine's speed drifts by 10-20% from minute to minute: a
ratio within one round is what that drift spares.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from engine_load import Load, burst, engine_run, prompts
from proctree import children, cpu_seconds, git_commit, machine, machine_seconds, name_of

REPO_ROOT = Path(__file__).resolve().parents[1]
BURST_N = 8
BUSY_SHARE = 0.2  # a thread busy for this share of a row computes (module docstring)
Probe = Callable[[str], contextlib.AbstractContextManager[None]]
SMOKE = {"rounds": 1, "new_tokens": 8, "concurrency": [1, 4], "burst_prompts": 4,
         "burst_new_tokens": 4}  # fmt: skip


def row_names(args) -> list[str]:
    return [*(f"c{c}" for c in args.concurrency), "grpo n=8", f"grpo {burst_rows(args)} x 1"]


def burst_rows(args) -> int:
    return args.burst_prompts * BURST_N


def expected_tokens(args, name: str) -> int:
    if name.startswith("grpo"):
        return burst_rows(args) * args.burst_new_tokens
    concurrency = int(name[1:])
    return max(8, 2 * concurrency) * args.new_tokens


def one_round(url: str, args, r: int, probe: Probe) -> dict[str, Load]:
    """Every row once on the engine at `url`; `probe` brackets each row (the thread check).
    Round `r` picks the prompts: the same for both engines, new every round."""
    out: dict[str, Load] = {}
    for c in args.concurrency:
        batch = prompts(max(8, 2 * c), args.prompt_tokens, seed=1000 * r + c)
        with probe(f"c{c}"):
            out[f"c{c}"] = asyncio.run(engine_run(url, batch, args.new_tokens, c, 1.0))
    group = prompts(args.burst_prompts, args.prompt_tokens, seed=1000 * r + 999)
    with probe("grpo n=8"):
        out["grpo n=8"] = asyncio.run(burst(url, group, BURST_N, args.burst_new_tokens))
    singles = [p for p in group for _ in range(BURST_N)]
    name = f"grpo {burst_rows(args)} x 1"
    with probe(name):
        out[name] = asyncio.run(burst(url, singles, 1, args.burst_new_tokens))
    return out


# -- what each engine's processes did during a row ---------------------------------------------


def tree_seconds(root: int) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """CPU seconds so far of `root`'s process tree: by (pid, tid) for its live threads (the
    busy-thread count), and by pid for its processes (the cores busy: a process's count keeps
    the seconds of its threads that ended)."""
    threads, processes = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in [root, *children(root)]:
        total = cpu_seconds(pid)
        if total is None:
            continue
        processes[pid] = total
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, IndexError):
                    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1]
                    utime, stime = fields.split()[11:13]
                    threads[(pid, int(tid))] = (int(utime) + int(stime)) / tick
    return threads, processes


class CpuProbe:
    """Around each row: per engine, its model process's busy threads and its tree's cores
    busy; this process's (the client's) cores busy; the machine's busy cores outside both
    trees and this client ("other": anything else the machine ran meanwhile)."""

    def __init__(self, roots: dict[str, tuple[int, str]]):
        self.roots = roots  # engine label -> (root pid, name of its model process)
        # millstream's engine serves HTTP on its main thread and computes on a thread of its
        # own (engine/scheduler.py); SGLang's HTTP is a process of its own and its scheduler
        # computes on its main thread: only the threads that compute are counted.
        self.skip_main = {"millstream"}
        # (engine, row) -> per round: busy threads, cores busy, the client's cores, other's
        self.rows: dict[tuple[str, str], list[tuple[int, float, float, float]]] = {}

    @contextlib.contextmanager
    def around(self, engine: str, row: str) -> Iterator[None]:
        before = {label: tree_seconds(pid) for label, (pid, _) in self.roots.items()}
        mine0, machine0, t0 = time.process_time(), machine_seconds()["(machine)"], time.time()
        yield
        wall = time.time() - t0
        busy_machine = machine_seconds()["(machine)"] - machine0
        client = time.process_time() - mine0
        used, threads, cores = client, 0, 0.0
        for label, (pid, model_name) in self.roots.items():
            after_threads, after = tree_seconds(pid)
            spent = sum(v - before[label][1].get(p, 0.0) for p, v in after.items())
            used += spent
            if label == engine:
                model = {p for p in after if name_of(p) == model_name}
                busy = [
                    v - before[label][0].get((p, t), 0.0)
                    for (p, t), v in after_threads.items()
                    if p in model and not (t == p and label in self.skip_main)
                ]
                threads = sum(1 for s in busy if s >= BUSY_SHARE * wall)
                cores = spent / wall
        other = max(0.0, busy_machine - used) / wall
        self.rows.setdefault((engine, row), []).append((threads, cores, client / wall, other))

    def bind(self, engine: str) -> Probe:
        return lambda row: self.around(engine, row)


# -- the run ----------------------------------------------------------------------------------


def find_sglang_python(given: str | None) -> str:
    """--sglang-python, else $MILLSTREAM_SGLANG_PYTHON, else scripts/bootstrap_sglang.sh's
    venv (installed once per machine, ~11 GB, minutes the first time)."""
    from millstream.launch.engines import SGLANG_PYTHON_ENV

    python = given or os.environ.get(SGLANG_PYTHON_ENV)
    if not python:
        print("no $MILLSTREAM_SGLANG_PYTHON: scripts/bootstrap_sglang.sh", file=sys.stderr)
        script = REPO_ROOT / "scripts" / "bootstrap_sglang.sh"
        python = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True)
        python = python.stdout.strip().splitlines()[-1]
    os.environ[SGLANG_PYTHON_ENV] = python  # the launcher's command line reads it
    return python


def parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    return total


def run(args) -> int:
    from millstream.common.threads import pool_env
    from tests.sglang_live.server import CPU_SGLANG_ARGS, LiveSglang
    from tests.support.engine_proc import EngineProcess
    from tests.support.tiny_model import build_tiny_model

    python = find_sglang_python(args.sglang_python)
    ask = "import importlib.metadata as m; print(m.version('sglang'))"
    version = subprocess.run([python, "-c", ask], capture_output=True, text=True, check=True)
    pool = CPU_SGLANG_ARGS[CPU_SGLANG_ARGS.index("--sglang-max-total-tokens") + 1]
    env = pool_env(args.threads)
    names = row_names(args)
    with tempfile.TemporaryDirectory(prefix="bench-engine-peer-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_model(
            tmp / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
            num_kv_heads=2, context_length=8192,
        )  # fmt: skip
        params = parameters(model_dir)
        started = time.monotonic()
        sglang = LiveSglang(model_dir, tmp, "--sglang-max-running-requests",
                            str(args.max_running_requests), env=env)  # fmt: skip
        ours = None
        try:
            sglang.start()
            ours = EngineProcess(
                model_dir, tmp, "--num-threads", str(args.threads), "--dtype", "float32",
                "--max-running-requests", str(args.max_running_requests),
                "--max-total-tokens", pool, startup_timeout_s=300, env=env,
            )  # fmt: skip
            print(f"both up in {time.monotonic() - started:.0f} s", file=sys.stderr)
            engines = {"millstream": (ours.url, ours.proc.pid, "engine"),
                       "SGLang": (sglang.url, sglang.proc.pid, "sglang::scheduler")}  # fmt: skip
            probe = CpuProbe({k: (pid, model) for k, (_, pid, model) in engines.items()})
            warm = argparse.Namespace(**{**vars(args), **SMOKE})
            for url, _, _ in engines.values():  # discarded: first-request costs of each
                one_round(url, warm, -1, lambda _: contextlib.nullcontext())
            rounds: dict[str, list[dict[str, Load]]] = {k: [] for k in engines}
            order = list(engines)
            for r in range(args.rounds):
                for label in order if r % 2 == 0 else order[::-1]:
                    url = engines[label][0]
                    try:
                        rounds[label].append(one_round(url, args, r, probe.bind(label)))
                    except Exception:
                        tail = ours.log_tail() if label == "millstream" else sglang.tail()
                        print(f"{label} failed in round {r + 1}; its log:\n{tail}", file=sys.stderr)
                        raise
                mine, theirs = rounds["millstream"][-1], rounds["SGLang"][-1]
                line = "  ".join(f"{n} {mine[n].rate / theirs[n].rate:.2f}x" for n in names)
                print(f"round {r + 1}/{args.rounds}, tok/s ratio: {line}", file=sys.stderr)
            ours_log = ours.log_path.read_text(errors="replace")
            sglang_log = sglang.log_path.read_text(errors="replace")
        finally:
            if ours is not None:
                ours.stop()
            sglang.stop()

    check_same_work(args, rounds)
    print(
        f"machine: {machine()}; commit {git_commit()}; SGLang {version.stdout.strip()} from {python}"
    )
    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, 8k context, "
          f"~{params / 1e6:.1f}M parameters, fp32; {args.prompt_tokens}-token prompts; "
          f"{args.threads} compute thread(s) each; --max-running-requests "
          f"{args.max_running_requests} and a pool of {pool} tokens each")  # fmt: skip
    print(threads_said(ours_log, sglang_log))
    print()
    print(table(args, rounds))
    print()
    print(cpu_table(args, probe))
    return 0


def threads_said(ours_log: str, sglang_log: str) -> str:
    """What each engine's log says of its threads (module docstring: Threads)."""
    said = [line.strip() for line in ours_log.splitlines() if "compute thread" in line][:1]
    said += [line.split("] ", 1)[-1].strip() for line in sglang_log.splitlines()
             if "init_threads_binding" in line or "init_cpu_threads_env" in line][:2]  # fmt: skip
    return "threads, as the engines logged them: " + " | ".join(said or ["(nothing logged)"])


def check_same_work(args, rounds: dict[str, list[dict[str, Load]]]) -> None:
    """Both engines generated requests x new tokens in every row of every round, with a
    log-prob for each (the burst rows): else the ratios compare different work."""
    bad = []
    for label, runs in rounds.items():
        for r, rows in enumerate(runs):
            for name, load in rows.items():
                want = expected_tokens(args, name)
                if load.tokens != want or load.short_logprobs:
                    bad.append(
                        f"{label} round {r + 1} {name}: {load.tokens} tokens (want {want}), "
                        f"{load.short_logprobs} samples short of log-probs"
                    )
    if bad:
        raise SystemExit("the engines did not do the same work:\n" + "\n".join(bad))


def p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[98]


METRICS: dict[str, Callable[[Load], float]] = {
    "tok/s": lambda load: load.rate,
    "p50 ms": lambda load: 1000 * statistics.median(load.latencies),
    "p99 ms": lambda load: 1000 * p99(load.latencies),
}


def summary(rounds: dict[str, list[dict[str, Load]]], name: str, metric: str) -> tuple:
    """(millstream's median, SGLang's median, median of the paired ratios) of one row."""
    f = METRICS[metric]
    ours = [f(rows[name]) for rows in rounds["millstream"]]
    theirs = [f(rows[name]) for rows in rounds["SGLang"]]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(ours), statistics.median(theirs), statistics.median(ratios)


def table(args, rounds: dict[str, list[dict[str, Load]]]) -> str:
    n = len(rounds["millstream"])
    lines = [
        f"| row | requests x new tokens | millstream tok/s | SGLang tok/s | tok/s × SGLang "
        f"(median of {n} paired) | p50 ms, millstream / SGLang | p50 × | p99 ms, millstream / "
        "SGLang | p99 × |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in row_names(args):
        if name.startswith("grpo"):
            each = f"{args.burst_prompts} x n=8" if "n=8" in name else f"{burst_rows(args)}"
            size = f"{each} x {args.burst_new_tokens}, at once"
        else:
            size = f"{max(8, 2 * int(name[1:]))} x {args.new_tokens}"
        a, b, ratio = summary(rounds, name, "tok/s")
        p50 = summary(rounds, name, "p50 ms")
        p99_ = summary(rounds, name, "p99 ms")
        lines.append(
            f"| {name} | {size} | {a:.0f} | {b:.0f} | {ratio:.2f}x | {p50[0]:.0f} / {p50[1]:.0f} "
            f"| {p50[2]:.2f}x | {p99_[0]:.0f} / {p99_[1]:.0f} | {p99_[2]:.2f}x |"
        )
    return "\n".join(lines)


def cpu_table(args, probe: CpuProbe) -> str:
    """Per row and engine, over the rounds: the most busy threads its model process had, and
    the medians of its tree's busy cores, the client's, and the machine's other load."""
    lines = [
        "| row | engine | busy compute threads (most) | its cores busy | "
        "the client's cores busy | other load, cores |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in row_names(args):
        for engine, model in (("millstream", "engine"), ("SGLang", "scheduler")):
            seen = probe.rows[(engine, name)]
            threads = max(t for t, *_ in seen)
            cores, client, other = (statistics.median(x[i] for x in seen) for i in (1, 2, 3))
            lines.append(
                f"| {name} | {engine} | {threads} ({model}) | {cores:.2f} | {client:.2f} "
                f"| {other:.2f} |"
            )
    return "\n".join(lines)
