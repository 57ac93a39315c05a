"""What long rollouts cost on the way through Redis: responses of 1k, 8k and 32k tokens.

    .venv/bin/python bench/bench_long_rollouts.py              # T = 1024, 8192, 32768; n = 16
    .venv/bin/python bench/bench_long_rollouts.py --quick      # T = 256, 1024; n = 4 (tests)

The arith job's services (the real router, rollout and reward workers, Redis) in front of one
simulated engine (bench/fleet_engine.py: infinitely fast, every response exactly T tokens,
EOS ignored, a 152k vocabulary, 4 bytes of text a token). For each T the bench publishes K
prompt groups of n samples (prompt --prompt-len tokens) and waits for their ScoredGroups;
nothing trims the streams meanwhile, so every group is in flight as far as Redis is concerned.
Per group:

  * bytes of its entry in each stream (`prompts`, `generated`, `scored`) and per response token;
  * Redis memory: MEMORY USAGE of the streams and INFO used_memory, before and after, over K;
  * protobuf decode and encode of its ScoredGroup (median of --reps), as the trainer and the
    reward worker do them;
  * the trainer's read: millstream's Buffer (trainer/buffer.py) reading `scored` (XREADGROUP,
    decode, accounting) and the batch build (trainer/batch.py);
  * CPU (core-ms, /proc/<pid>/stat) of the router, the rollout and reward workers and Redis,
    and the wall time per group with K groups in flight;
  * compression (zlib level 1 and 6 of the ScoredGroup's bytes) against what the bytes cost
    Redis (an XADD of them), and which fields the bytes are.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from proctree import RoleSampler, git_commit, machine  # noqa: E402

from tests.support.fleet import FleetProcess  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.router_proc import ServiceProcess  # noqa: E402
from tests.support.worker_procs import WorkerProcs  # noqa: E402

MB = 1e6
GROUPS_TIMEOUT_S = 600.0  # a row's groups scored within this, else the bench says how far it got


@dataclass
class Row:
    tokens: int
    n: int
    groups: int
    bytes: dict[str, float] = field(default_factory=dict)  # stream -> bytes per group
    redis_usage: float = 0.0  # MEMORY USAGE of generated + scored, per group
    redis_used: float = 0.0  # INFO used_memory delta per group
    decode_ms: float = 0.0
    encode_ms: float = 0.0
    read_ms: float = 0.0  # the trainer's buffer, per group
    build_ms: float = 0.0
    cpu_ms: dict[str, float] = field(default_factory=dict)  # role -> core-ms per group
    wall_s: float = 0.0  # per group, K in flight
    zlib: dict[str, float] = field(default_factory=dict)
    xadd_ms: float = 0.0
    shares: dict[str, float] = field(default_factory=dict)  # field -> share of a sample's bytes


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def field_shares(data: bytes) -> dict[str, float]:
    """Which fields a ScoredGroup's bytes are: each Sample field serialized alone."""
    from millstream.common.types import Sample, ScoredGroup

    scored = ScoredGroup.FromString(data)
    sizes = dict.fromkeys(
        ("response_token_ids", "rollout_logprobs", "loss_mask", "weight_versions",
         "response_text", "prompt_token_ids"), 0,
    )  # fmt: skip
    for s in scored.group.samples:
        for name in sizes:
            one = Sample()
            value = getattr(s, name)
            if isinstance(value, str):
                setattr(one, name, value)
            else:
                getattr(one, name).extend(value)
            sizes[name] += one.ByteSize()
    total = len(data)
    out = {name: size / total for name, size in sizes.items()}
    out["other"] = max(0.0, 1 - sum(out.values()))
    return out


async def measure(row: Row, args: argparse.Namespace, redis_url: str, run_id: str, sampler):
    from millstream.common import streams
    from millstream.common.config import parse_run_config
    from millstream.common.keys import RunKeys
    from millstream.common.redis_conn import connect
    from millstream.common.types import PromptGroup, ScoredGroup
    from millstream.trainer.batch import build_samples
    from millstream.trainer.buffer import Buffer

    keys = RunKeys(run_id)
    redis = await connect(redis_url, who="bench")
    try:
        before = (await redis.info("memory"))["used_memory"]
        groups = [
            PromptGroup(
                group_id=f"g{i}", data_index=i, label="x", n_samples=row.n,
                prompt_token_ids=[(i * 131 + j * 17) % 150_000 for j in range(args.prompt_len)],
                admitted_unix=time.time(),
            )
            for i in range(row.groups)
        ]  # fmt: skip
        sampler.sample()
        t0 = time.time()
        await streams.publish_many(redis, keys.prompts, groups)
        deadline = t0 + GROUPS_TIMEOUT_S
        while (done := await redis.xlen(keys.scored)) < row.groups:
            if time.time() > deadline:
                dead = await redis.xlen(keys.dead)
                raise RuntimeError(
                    f"T={row.tokens}: {done} of {row.groups} groups scored after "
                    f"{GROUPS_TIMEOUT_S:.0f} s ({dead} dead-lettered): see the service logs"
                )
            await asyncio.sleep(0.02)
        t1 = time.time()
        await asyncio.sleep(0.2)  # the work after the last hand-off (its ack, a heartbeat)
        sampler.sample()
        first, last = sampler.samples[-2], sampler.samples[-1]
        cpu = {role: last.get(role, 0.0) - first.get(role, 0.0) for role in last}
        row.cpu_ms = {
            r: 1e3 * cpu.get(r, 0.0) / row.groups for r in ("router", "rollout", "reward", "redis")
        }
        row.wall_s = (t1 - t0) / row.groups
        after = (await redis.info("memory"))["used_memory"]
        row.redis_used = (after - before) / row.groups
        usage = 0
        for name, stream in (("prompts", keys.prompts), ("generated", keys.generated),
                             ("scored", keys.scored)):  # fmt: skip
            entries = await redis.xrange(stream)
            row.bytes[name] = statistics.mean(len(f[b"data"]) for _, f in entries)
            if name != "prompts":
                usage += await redis.memory_usage(stream, samples=0)
        row.redis_usage = usage / row.groups
        data = (await redis.xrange(keys.scored, count=1))[0][1][b"data"]
        scored = ScoredGroup.FromString(data)
        made = sum(len(s.response_token_ids) for s in scored.group.samples)
        assert made == row.n * row.tokens, (made, scored.reason, scored.group.failure_reason)
        row.decode_ms = _median_ms(lambda: ScoredGroup.FromString(data), args.reps)
        row.encode_ms = _median_ms(scored.SerializeToString, args.reps)
        row.shares = field_shares(data)
        for level in (1, 6):
            packed = zlib.compress(data, level)
            row.zlib[f"ratio{level}"] = len(data) / len(packed)
            squeeze = functools.partial(zlib.compress, data, level)
            row.zlib[f"compress{level}_ms"] = _median_ms(squeeze, args.reps)
            unsqueeze = functools.partial(zlib.decompress, packed)
            row.zlib[f"decompress{level}_ms"] = _median_ms(unsqueeze, args.reps)
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            await redis.xadd("bench:xadd", {"data": data})
            times.append(time.perf_counter() - t)
            await redis.delete("bench:xadd")
        row.xadd_ms = 1e3 * statistics.median(times)

        # The trainer's read: its buffer over `scored`, then the batch build.
        cfg = parse_run_config(run_flags(row, args, run_id, "http://unused:1"), mode="async")
        buffer = Buffer(
            redis, keys, "bench-trainer", claim_idle_ms=60_000, max_deliveries=5, block_ms=200,
            on_terminal=lambda gid, state: None, expected=lambda gid: True,
        )  # fmt: skip
        r0 = time.perf_counter()
        await buffer.start()
        while buffer.ready < row.groups:
            buffer.check()
            await asyncio.sleep(0.001)
        taken = await buffer.take(row.groups, 0, None)
        row.read_ms = 1e3 * (time.perf_counter() - r0) / row.groups
        b0 = time.perf_counter()
        build_samples(taken, 0, cfg)
        row.build_ms = 1e3 * (time.perf_counter() - b0) / row.groups
        await buffer.stop()
    finally:
        await redis.aclose()


def run_flags(row: Row, args: argparse.Namespace, run_id: str, router_url: str) -> list[str]:
    return [
        "--run-id", run_id, "--router-url", router_url,
        "--rollout-batch-size", str(row.groups), "--n-samples-per-prompt", str(row.n),
        "--rollout-max-response-len", str(row.tokens), "--rm-type", "exact",
        "--rollout-max-concurrency", str(args.concurrency), "--log-level", "warning",
    ]  # fmt: skip


def measure_row(tokens: int, groups: int, args: argparse.Namespace, tmp: Path) -> Row:
    from millstream.common.config import parse_run_config
    from millstream.common.config import store as config_store

    row = Row(tokens=tokens, n=args.n, groups=groups)
    work = tmp / f"t{tokens}"
    work.mkdir()
    started: list = []
    sampler = RoleSampler()  # sampled by hand, before and after the groups (no thread)
    try:
        redis = RedisServer(work)
        started.append(redis)
        sampler.add(redis.proc.pid, "redis")
        fleet = FleetProcess(work, 1)
        started.append(fleet)
        sampler.add(fleet.pid, "fleet (sim)")
        router = ServiceProcess(
            "router", ["--worker-urls", *fleet.urls, "--log-level", "warning"], work
        )
        started.append(router)
        router.wait_ready("/readiness", timeout_s=60)
        sampler.add(router.proc.pid, "router")
        run_id = f"long-{tokens}-{uuid.uuid4().hex[:6]}"
        cfg = parse_run_config(run_flags(row, args, run_id, router.url), mode="async")

        async def publish() -> None:
            from millstream.common.redis_conn import connect

            client = await connect(redis.url)
            await config_store.publish(client, cfg)
            await client.aclose()

        asyncio.run(publish())
        workers = WorkerProcs(redis.url, run_id, work)
        started.append(workers)
        for kind in ("rollout", "reward"):
            proc = workers.spawn(
                kind, f"{kind}-0", ["--consumer-name", f"{kind}-0", "--log-level", "warning"]
            )
            sampler.add(proc.pid, kind)
        for kind in ("rollout", "reward"):
            workers.wait_beating(kind, f"{kind}-0", timeout_s=120)
        asyncio.run(measure(row, args, redis.url, run_id, sampler))
        return row
    finally:
        for thing in reversed(started):
            if isinstance(thing, WorkerProcs):
                thing.stop_all()
            else:
                thing.stop()


def print_tables(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    t = Table(title="long rollouts through Redis, per group (n samples of T tokens, EOS ignored)")
    for col in ("T tokens", "n", "K in flight", "prompts kB", "generated MB", "scored MB",
                "scored B/token", "Redis MEMORY USAGE MB", "Redis used_memory MB",
                "decode ms", "encode ms", "trainer read ms", "batch build ms",
                "rollout core-ms", "reward core-ms", "router core-ms", "redis core-ms",
                "wall s"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r.tokens), str(r.n), str(r.groups), f"{r.bytes['prompts'] / 1e3:.2f}",
            f"{r.bytes['generated'] / MB:.2f}", f"{r.bytes['scored'] / MB:.2f}",
            f"{r.bytes['scored'] / (r.n * r.tokens):.1f}", f"{r.redis_usage / MB:.2f}",
            f"{r.redis_used / MB:.2f}", f"{r.decode_ms:.1f}", f"{r.encode_ms:.1f}",
            f"{r.read_ms:.1f}", f"{r.build_ms:.1f}", f"{r.cpu_ms['rollout']:.0f}",
            f"{r.cpu_ms['reward']:.0f}", f"{r.cpu_ms['router']:.0f}", f"{r.cpu_ms['redis']:.1f}",
            f"{r.wall_s:.2f}",
        )  # fmt: skip
    console.print(t)
    base = rows[0]
    ratio = Table(title=f"ratio to T = {base.tokens}")
    for col in ("T tokens", "tokens", "scored bytes", "Redis memory", "decode", "trainer read",
                "rollout CPU", "reward CPU", "router CPU", "redis CPU"):  # fmt: skip
        ratio.add_column(col, justify="right")
    for r in rows:

        def x(a: float, b: float) -> str:
            return f"{a / b:.1f}x" if b else "-"

        ratio.add_row(
            str(r.tokens), x(r.tokens * r.n, base.tokens * base.n),
            x(r.bytes["scored"], base.bytes["scored"]), x(r.redis_usage, base.redis_usage),
            x(r.decode_ms, base.decode_ms), x(r.read_ms, base.read_ms),
            x(r.cpu_ms["rollout"], base.cpu_ms["rollout"]), x(r.cpu_ms["reward"], base.cpu_ms["reward"]),
            x(r.cpu_ms["router"], base.cpu_ms["router"]), x(r.cpu_ms["redis"], base.cpu_ms["redis"]),
        )  # fmt: skip
    console.print(ratio)
    z = Table(title="compressing a ScoredGroup (zlib) against what its bytes cost Redis")
    for col in ("T tokens", "XADD ms", "zlib-1 ratio", "zlib-1 in+out ms", "zlib-6 ratio",
                "zlib-6 in+out ms", "token ids", "logprobs", "text", "mask", "versions", "rest"):  # fmt: skip
        z.add_column(col, justify="right")
    for r in rows:
        s = r.shares
        z.add_row(
            str(r.tokens), f"{r.xadd_ms:.2f}", f"{r.zlib['ratio1']:.2f}",
            f"{r.zlib['compress1_ms'] + r.zlib['decompress1_ms']:.1f}", f"{r.zlib['ratio6']:.2f}",
            f"{r.zlib['compress6_ms'] + r.zlib['decompress6_ms']:.1f}",
            f"{s['response_token_ids']:.0%}", f"{s['rollout_logprobs']:.0%}",
            f"{s['response_text']:.0%}", f"{s['loss_mask']:.0%}", f"{s['weight_versions']:.0%}",
            f"{s['other'] + s['prompt_token_ids']:.0%}",
        )  # fmt: skip
    console.print(z)
    print_markdown(rows)
    last = rows[-1]
    spent = last.cpu_ms["rollout"] + last.cpu_ms["reward"] + last.decode_ms + last.read_ms
    console.print(
        f"T={last.tokens}: one group is {last.bytes['scored'] / MB:.1f} MB on `scored` and Redis "
        f"holds {last.redis_usage / MB:.1f} MB of it while it is in flight (generated + scored). "
        f"Redis spends {last.cpu_ms['redis']:.1f} core-ms on it and an XADD of its bytes takes "
        f"{last.xadd_ms:.1f} ms; the workers and the trainer spend {spent:.0f} core-ms, and zlib-1 "
        f"would add {last.zlib['compress1_ms'] + last.zlib['decompress1_ms']:.0f} ms a hop to save "
        f"{1 - 1 / last.zlib['ratio1']:.0%} of the bytes."
    )


def print_markdown(rows: list[Row]) -> None:
    """The main rows as a markdown table (docs/benchmarks.md)."""
    head = ["T", "n", "scored MB", "B/token", "Redis MB in flight (MEMORY USAGE / used_memory)",
            "decode / encode ms", "trainer read / build ms", "rollout / reward / router / redis core-ms",
            "zlib-1: ratio, ms a hop", "XADD ms"]  # fmt: skip
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        c = r.cpu_ms
        cells = [
            str(r.tokens), str(r.n), f"{r.bytes['scored'] / MB:.2f}",
            f"{r.bytes['scored'] / (r.n * r.tokens):.1f}",
            f"{r.redis_usage / MB:.2f} / {r.redis_used / MB:.2f}",
            f"{r.decode_ms:.1f} / {r.encode_ms:.1f}", f"{r.read_ms:.1f} / {r.build_ms:.1f}",
            f"{c['rollout']:.0f} / {c['reward']:.0f} / {c['router']:.0f} / {c['redis']:.1f}",
            f"{r.zlib['ratio1']:.2f}, {r.zlib['compress1_ms'] + r.zlib['decompress1_ms']:.1f}",
            f"{r.xadd_ms:.2f}",
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,8192,32768")
    p.add_argument("--groups", default="16,8,4", help="K groups in flight of each row")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="T = 256, 1024; n = 4; 2 groups")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.groups, args.n, args.reps = "256,1024", "2,2", 4, 3
    tokens = [int(x) for x in args.tokens.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    info = machine()
    print(
        f"machine: {info['cpu_model']}, {info['cores_usable']} cores, {info['memory_gib']} GiB; "
        f"commit {git_commit()}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        for t, k in zip(tokens, groups, strict=True):
            rows.append(measure_row(t, k, args, Path(tmp)))
            r = rows[-1]
            print(
                f"T={t}: scored {r.bytes['scored'] / MB:.2f} MB a group, Redis "
                f"{r.redis_usage / MB:.2f} MB, {r.wall_s:.2f} s a group",
                flush=True,
            )
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
