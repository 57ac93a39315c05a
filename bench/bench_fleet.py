"""How millstream's own cost grows with the fleet: N simulated engines in front of the real
router, rollout and reward workers, Redis and the trainer's admission, buffer and weight sync.

    .venv/bin/python bench/bench_fleet.py                      # N = 1, 8, 64, 256
    .venv/bin/python bench/bench_fleet.py --quick              # N = 1, 2, short windows
    .venv/bin/python bench/bench_fleet.py --engines 1,64 --seconds 30 --json out.json

One row per N, each on fresh processes (one after another on this machine):

  * groups/s: what the control plane sustains with infinitely fast engines (the latency model
    of bench/fleet_engine.py at zero: every answer at once), the trainer's step a stated cost
    (--step-ms, 0 by default), measured over a window after a warm-up (bench/fleet_trainer.py);
  * CPU seconds per 1,000 groups of the router, the rollout worker(s), the reward worker(s),
    the trainer (admission, buffer, janitor; its batch building too) and Redis, from
    /proc/<pid>/stat over that window; and the simulated fleet's own, which a real fleet
    spends on its GPUs' hosts;
  * the router at rest: its CPU with N engines and nothing to route (its health checks, every
    --health-interval seconds);
  * the router's added latency: /generate (1 token) sent one at a time through the router and
    straight to an engine, p50 and p99 of the difference (--latency-requests each, rounds
    interleaved);
  * the weight-sync handshake against N: the trainer's real WeightSync (pause every engine,
    update from disk, continue them and gate the router), --syncs times; the engines model the
    data transfer as --transfer-gb at --bandwidth-gbs (a pipelined broadcast: the same time
    for any N), so the table shows it apart from the handshake's own time.

The job of each row: --batch groups a step of --n samples, --tokens new tokens each,
--prompt-len prompt tokens, --max-staleness versions in flight. Ratios are against the
first row. On a small machine every process shares the same cores: the last lines say what
the machine bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_router import Conn  # noqa: E402
from fleet_engine import LatencyModel, model_argv  # noqa: E402
from proctree import RoleSampler, git_commit, machine  # noqa: E402

from tests.support.fleet import FleetProcess  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.router_proc import ServiceProcess  # noqa: E402
from tests.support.worker_procs import WorkerProcs  # noqa: E402

ROLES = ("router", "rollout", "reward", "trainer", "redis", "fleet (sim)")
MILLSTREAM_ROLES = ROLES[:5]


@dataclass
class Row:
    engines: int
    groups_per_s: float = 0.0
    window_s: float = 0.0
    cpu_per_1000: dict[str, float] = field(default_factory=dict)  # role -> CPU s / 1000 groups
    cores_busy: float = 0.0  # the whole machine's, over the window
    router_idle_pct: float = 0.0  # of one core, with nothing to route
    latency: dict[str, float] = field(default_factory=dict)  # direct/router p50/p99, ms
    sync: dict[str, float] = field(default_factory=dict)  # phase -> median seconds
    sync_cpu: dict[str, float] = field(default_factory=dict)  # role -> CPU s per sync
    build_ms_per_group: float | None = None
    counts: dict[str, int] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latencies(direct: str, routed: str, n: int, rounds: int = 4) -> dict[str, float]:
    """/generate of 1 token, one at a time, to `direct` (an engine) and through `routed`,
    `n` each in `rounds` interleaved rounds; p50/p99 in ms and the added p50/p99."""
    body = json.dumps(
        {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 1}}
    ).encode()
    found: dict[str, list[float]] = {"direct": [], "router": []}
    conns = {
        name: Conn("127.0.0.1", int(url.rsplit(":", 1)[1]))
        for name, url in (("direct", direct), ("router", routed))
    }
    for conn in conns.values():  # warm: connections, caches
        for _ in range(20):
            await conn.request("POST", "/generate", body)
    for _ in range(rounds):
        for name, conn in conns.items():
            for _ in range(n // rounds):
                t = time.perf_counter()
                status, data = await conn.request("POST", "/generate", body)
                found[name].append(time.perf_counter() - t)
                if status != 200:
                    raise RuntimeError(f"{name} /generate: HTTP {status} {data[:200]!r}")
    for conn in conns.values():
        await conn.close()
    out = {}
    for name, values in found.items():
        out[f"{name}_p50"] = 1e3 * percentile(values, 0.5)
        out[f"{name}_p99"] = 1e3 * percentile(values, 0.99)
    out["added_p50"] = out["router_p50"] - out["direct_p50"]
    out["added_p99"] = out["router_p99"] - out["direct_p99"]
    return out


def run_flags(args: argparse.Namespace) -> list[str]:
    """The run config's flags (what `millstream train-async` would take)."""
    return [
        "--rollout-batch-size", str(args.batch), "--n-samples-per-prompt", str(args.n),
        "--rollout-max-response-len", str(args.tokens), "--rm-type", "exact",
        "--max-staleness", str(args.max_staleness),
        "--rollout-max-concurrency", str(args.rollout_concurrency),
        "--log-level", "warning",
    ]  # fmt: skip


def measure_row(n: int, args: argparse.Namespace, model: LatencyModel, tmp: Path) -> Row:
    row = Row(engines=n)
    work = tmp / f"n{n}"
    work.mkdir()
    sampler = RoleSampler(every_s=0.2)
    started: list = []
    redis = RedisServer(work)
    started.append(redis)
    sampler.add(redis.proc.pid, "redis")
    try:
        fleet = FleetProcess(work, n, model_argv(model))
        started.append(fleet)
        sampler.add(fleet.pid, "fleet (sim)")
        router = ServiceProcess(
            "router",
            ["--worker-urls", *fleet.urls, "--health-check-interval", str(args.health_interval),
             "--log-level", "warning"],
            work,
        )  # fmt: skip
        started.append(router)
        router.wait_ready("/readiness", timeout_s=60)
        sampler.add(router.proc.pid, "router")
        sampler.start()

        # The router at rest: health checks only.
        time.sleep(1.0)
        t0 = time.time()
        time.sleep(args.idle_seconds)
        row.router_idle_pct = (
            100 * sampler.between(t0, time.time()).get("router", 0) / (time.time() - t0)
        )
        row.latency = asyncio.run(latencies(fleet.urls[0], router.url, args.latency_requests))

        # The data path, then the weight syncs.
        run_id = f"fleet-{n}-{uuid.uuid4().hex[:6]}"
        out = work / "trainer.json"
        argv = [
            sys.executable, str(ROOT / "bench" / "fleet_trainer.py"),
            "--redis-url", redis.url, "--router-url", router.url, "--run-id", run_id,
            "--out", str(out), "--seconds", str(args.seconds), "--warmup", str(args.warmup),
            "--step-ms", str(args.step_ms), "--prompt-len", str(args.prompt_len),
            "--syncs", str(args.syncs), "--", *run_flags(args),
        ]  # fmt: skip
        with (work / "trainer.log").open("w") as log:
            trainer = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        started.append(trainer)
        sampler.add(trainer.pid, "trainer")
        workers = WorkerProcs(redis.url, run_id, work)
        started.append(workers)
        for kind, count in (("rollout", args.rollout_workers), ("reward", args.reward_workers)):
            for i in range(count):
                name = f"{kind}-{i}"
                proc = workers.spawn(
                    kind, name, ["--consumer-name", name, "--log-level", "warning"]
                )
                sampler.add(proc.pid, kind)
        for kind, count in (("rollout", args.rollout_workers), ("reward", args.reward_workers)):
            for i in range(count):
                workers.wait_beating(kind, f"{kind}-{i}", timeout_s=120)
        import redis as sync_redis

        client = sync_redis.Redis.from_url(redis.url)
        client.set(f"{run_id}:bench:go", "1")
        client.close()
        code = trainer.wait(timeout=args.seconds + 300)
        if code != 0:
            raise RuntimeError(
                f"fleet trainer exited {code}:\n{(work / 'trainer.log').read_text()[-3000:]}"
            )
        result = json.loads(out.read_text())
        sampler.stop()
        window = result["window"]
        row.groups_per_s = window["groups_per_s"]
        row.window_s = window["t1"] - window["t0"]
        row.build_ms_per_group = window["build_ms_per_group"]
        row.counts = result["counts"]
        cpu = sampler.between(window["t0"], window["t1"])
        groups = max(1, window["groups"])
        row.cpu_per_1000 = {role: 1000 * cpu.get(role, 0.0) / groups for role in ROLES}
        row.cores_busy = cpu.get("(machine)", 0.0) / max(1e-9, row.window_s)
        if syncs := result["syncs"]:
            phases = sorted({k for s in syncs for k in s if k not in ("engines", "t0", "t1")})
            row.sync = {k: statistics.median(s.get(k, 0.0) for s in syncs) for k in phases}
            used = sampler.between(syncs[0]["t0"], syncs[-1]["t1"])
            row.sync_cpu = {role: used.get(role, 0.0) / len(syncs) for role in ROLES}
        return row
    finally:
        sampler.stop()
        for thing in reversed(started):
            if isinstance(thing, subprocess.Popen):
                if thing.poll() is None:
                    thing.kill()
                    thing.wait()
            elif isinstance(thing, WorkerProcs):
                thing.stop_all()
            else:
                thing.stop()


def _cpu_of(role: str, row: Row) -> float:
    return row.cpu_per_1000[role]


def print_tables(rows: list[Row], args: argparse.Namespace, model: LatencyModel) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    transfer = model.update_s()
    job = (
        f"{args.batch} groups a step x {args.n} samples x {args.tokens} tokens (prompt "
        f"{args.prompt_len}), staleness {args.max_staleness}, {args.rollout_workers} rollout / "
        f"{args.reward_workers} reward worker(s), step {args.step_ms:g} ms"
    )
    table = Table(title=f"fleet: {job}; engines: {model.describe()}")
    for col in ["engines", "groups/s", *[f"{r} CPU s/1k groups" for r in ROLES],
                "cores busy", "router idle %", "router +p50 ms", "router +p99 ms",
                "sync pause s", "sync update s", "sync serve s", "sync total s",
                "sync less transfer s"]:  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        update = r.sync.get("disk", r.sync.get("tensor", 0.0))
        table.add_row(
            str(r.engines), f"{r.groups_per_s:.0f}",
            *[f"{r.cpu_per_1000[role]:.2f}" for role in ROLES], f"{r.cores_busy:.2f}",
            f"{r.router_idle_pct:.1f}", f"{r.latency['added_p50']:.2f}",
            f"{r.latency['added_p99']:.2f}", f"{r.sync.get('pause', 0):.3f}", f"{update:.3f}",
            f"{r.sync.get('serve', 0):.3f}", f"{r.sync.get('total', 0):.3f}",
            f"{r.sync.get('total', 0) - transfer:.3f}",
        )  # fmt: skip
    console.print(table)
    base = rows[0]
    ratios = Table(title=f"ratio to {base.engines} engine(s)")
    ratios.add_column("engines", justify="right")
    cols = [("groups/s", lambda r: r.groups_per_s)]
    cols += [(f"{role} CPU/group", functools.partial(_cpu_of, role)) for role in MILLSTREAM_ROLES]
    cols += [
        ("router idle CPU", lambda r: r.router_idle_pct),
        ("router +p50", lambda r: r.latency["added_p50"]),
        ("sync less transfer", lambda r: r.sync.get("total", 0) - transfer),
    ]
    for name, _ in cols:
        ratios.add_column(name, justify="right")
    for r in rows:
        cells = []
        for _, get in cols:
            b = get(base)
            cells.append(f"{get(r) / b:.2f}x" if b > 1e-9 else "-")
        ratios.add_row(str(r.engines), *cells)
    console.print(ratios)
    print_markdown(rows, transfer)
    for r in rows:
        per_check = 10 * r.router_idle_pct * args.health_interval / r.engines  # ms of CPU
        console.print(
            f"N={r.engines}: the router at rest: {r.router_idle_pct:.1f}% of a core, "
            f"{per_check:.2f} ms of CPU a health check ({r.engines} every "
            f"{args.health_interval:g} s)"
        )
    for r in rows:
        if r.sync_cpu:
            busiest = sorted(r.sync_cpu.items(), key=lambda kv: -kv[1])[:3]
            console.print(
                f"N={r.engines}: a weight sync took {r.sync.get('total', 0):.3f} s "
                f"({transfer:.2f} s of it the modeled transfer); CPU in it: "
                + ", ".join(f"{role} {cpu * 1e3:.0f} ms" for role, cpu in busiest)
            )
    for r in rows:
        ms = {role: r.cpu_per_1000[role] for role in ROLES}  # = core-ms per group
        ours = sum(ms[role] for role in MILLSTREAM_ROLES)
        total = sum(ms.values())
        busiest = max(MILLSTREAM_ROLES, key=lambda role: ms[role])
        cores = machine()["cores_usable"]
        console.print(
            f"N={r.engines}: {r.groups_per_s:.0f} groups/s with {r.cores_busy:.2f} of {cores} "
            f"cores busy; per group millstream's processes spend {ours:.2f} core-ms and the "
            f"simulated fleet {ms['fleet (sim)']:.2f}: {cores} cores bound the rate at "
            f"{1000 * cores / total:.0f} groups/s. The busiest, the {busiest} "
            f"({ms[busiest]:.2f} core-ms a group, one process on one core), alone at "
            f"{1000 / ms[busiest]:.0f} groups/s."
        )


def print_markdown(rows: list[Row], transfer: float) -> None:
    """The same rows as a markdown table (docs/benchmarks.md)."""
    head = ["engines", "groups/s", *[f"{r} ms/group" for r in ROLES], "router idle %",
            "router +p50 / +p99 ms", "sync pause / update / serve s", "sync less transfer s"]  # fmt: skip
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        update = r.sync.get("disk", r.sync.get("tensor", 0.0))
        cells = [
            str(r.engines), f"{r.groups_per_s:.0f}",
            *[f"{r.cpu_per_1000[role]:.2f}" for role in ROLES], f"{r.router_idle_pct:.1f}",
            f"{r.latency['added_p50']:.2f} / {r.latency['added_p99']:.2f}",
            f"{r.sync.get('pause', 0):.3f} / {update:.3f} / {r.sync.get('serve', 0):.3f}",
            f"{r.sync.get('total', 0) - transfer:.3f}",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="1,8,64,256", help="comma-separated N of each row")
    p.add_argument("--quick", action="store_true", help="N = 1, 2 and short windows (tests)")
    p.add_argument(
        "--seconds", type=float, default=25.0, help="the trainer's run, warm-up included"
    )
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--idle-seconds", type=float, default=5.0)
    p.add_argument(
        "--health-interval", type=float, default=5.0, help="the router's (its default: 5 s)"
    )
    p.add_argument("--latency-requests", type=int, default=400)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--rollout-concurrency", type=int, default=64)
    p.add_argument("--rollout-workers", type=int, default=1)
    p.add_argument("--reward-workers", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=0.0, help="the training step's stated cost")
    p.add_argument("--transfer-gb", type=float, default=16.0, help="weights one update moves")
    p.add_argument("--bandwidth-gbs", type=float, default=25.0)
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args()
    if args.quick:
        args.engines, args.seconds, args.warmup = "1,2", 8.0, 3.0
        args.idle_seconds, args.latency_requests, args.syncs = 1.0, 60, 2
        args.batch, args.transfer_gb = 16, 1.0
    model = LatencyModel(
        transfer_bytes=int(args.transfer_gb * 1e9), bandwidth_bytes_s=args.bandwidth_gbs * 1e9
    )
    info = machine()
    print(
        f"machine: {info['cpu_model']}, {info['cores_usable']} of {info['cores_total']} cores, "
        f"{info['memory_gib']} GiB; commit {git_commit()}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        for n in [int(x) for x in args.engines.split(",")]:
            row = measure_row(n, args, model, Path(tmp))
            rows.append(row)
            print(
                f"N={n}: {row.groups_per_s:.0f} groups/s, router +p50 "
                f"{row.latency['added_p50']:.2f} ms, sync {row.sync.get('total', 0):.3f} s",
                flush=True,
            )
    print_tables(rows, args, model)
    if args.json:
        Path(args.json).write_text(json.dumps([vars(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    sys.exit(main())
