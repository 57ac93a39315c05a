"""The fleet bench's trainer: millstream's real admission, buffer, janitor and weight sync, with
a training step of stated cost in place of a model.

    .venv/bin/python bench/fleet_trainer.py --redis-url URL --router-url URL --run-id ID \\
        --out result.json [--seconds 20 --warmup 5 --step-ms 0 --syncs 5 ...] -- [run flags]

It publishes the run config (the flags after `--`, as `millstream train-async` takes them), so
rollout and reward workers started with only --redis-url and --run-id join the run. Then:

  1. throughput: admission (trainer/admission.py) keeps the staleness budget full; the buffer
     (trainer/buffer.py) reads `{run}:scored`; each step takes a batch, builds its samples
     (trainer/batch.py: the trainer's read of a group) and sleeps --step-ms (the stated cost
     of a training step; 0: infinitely fast), then moves the version on (no weight sync: the
     data path alone). The janitor trims the streams every --trim-interval as the trainer's
     does. Groups trained between --warmup and --seconds are the window's.
  2. drain: admission stops; what is in flight comes back.
  3. weight sync: --syncs handshakes of the real WeightSync (trainer/weights/sync.py) with
     every engine the router lists, from disk (the simulated engines model the transfer:
     bench/fleet_engine.py), each timed by its phases.

Writes one JSON object to --out: the window (wall times, groups), and each sync's seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class Prompts:
    """A prompt source of synthetic rows (trainer/data.py's interface for Admission)."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.taken = 0

    def take(self, k: int) -> list:
        from millstream.trainer.data import PromptRow

        rows = []
        for i in range(self.taken, self.taken + k):
            ids = [(i * 31 + j * 7) % 50_000 + 100 for j in range(self.prompt_len)]
            rows.append((PromptRow(i, "", ids, "no", {}), 0))
        self.taken += k
        return rows

    def row(self, i: int) -> Any:
        raise NotImplementedError("no resumes here")

    def release(self, data_index: int) -> None:
        pass

    def state_dict(self, *_: Any) -> dict:
        return {}


async def run(args: argparse.Namespace, run_flags: list[str]) -> dict[str, Any]:
    from millstream.common.config import parse_run_config
    from millstream.common.config import store as config_store
    from millstream.common.keys import RunKeys
    from millstream.common.redis_conn import connect
    from millstream.common.streams import default_consumer_name
    from millstream.trainer.admission import Admission
    from millstream.trainer.batch import build_samples
    from millstream.trainer.buffer import Buffer
    from millstream.trainer.janitor import Tidied, run_janitor

    argv = ["--run-id", args.run_id, "--router-url", args.router_url, *run_flags]
    cfg = parse_run_config(argv, mode="async")
    redis = await connect(args.redis_url, who="fleet-trainer")
    keys = RunKeys(cfg.run_id)
    await config_store.publish(redis, cfg)
    # The workers read the config and start; the bench says go once each one beats.
    while not await redis.exists(f"{cfg.run_id}:bench:go"):
        await asyncio.sleep(0.05)
    r = cfg.rollout
    admission = Admission(
        redis, keys.prompts, Prompts(args.prompt_len), r.rollout_batch_size,  # type: ignore[arg-type]
        r.n_samples_per_prompt, cfg.max_staleness,
    )  # fmt: skip
    wake = asyncio.Event()

    def on_terminal(gid: str, state: str) -> None:
        admission.terminal(gid, state)
        wake.set()

    buffer = Buffer(
        redis, keys, default_consumer_name("trainer"), claim_idle_ms=cfg.service.claim_idle_ms,
        max_deliveries=cfg.service.max_deliveries, block_ms=cfg.service.stream_block_ms,
        on_terminal=on_terminal, expected=admission.in_flight.__contains__,
    )  # fmt: skip
    await buffer.start()
    version = 0

    async def pump() -> None:
        while True:
            await admission.fill(version)
            await wake.wait()
            wake.clear()

    pumping = asyncio.create_task(pump())
    buffer.watch_feeder(pumping)
    janitor = asyncio.create_task(
        run_janitor(redis, keys, interval_s=args.trim_interval, consumer_idle_ms=600_000,
                    tidied=Tidied())
    )  # fmt: skip
    start = time.time()
    t0 = start + args.warmup
    t1 = start + args.seconds
    in_window = steps = 0
    build_s: list[float] = []
    while time.time() < t1:
        # Polled (2 ms), not awaited: a take cancelled at the window's end could leave groups
        # it had popped neither kept nor terminal.
        if buffer.ready < r.rollout_batch_size:
            buffer.check()
            await asyncio.sleep(0.002)
            continue
        groups = await buffer.take(r.rollout_batch_size, version, None)
        b0 = time.perf_counter()
        build_samples(groups, version, cfg)
        build_s.append(time.perf_counter() - b0)
        if args.step_ms:
            await asyncio.sleep(args.step_ms / 1e3)
        version += 1
        steps += 1
        wake.set()
        now = time.time()
        if t0 <= now <= t1:
            in_window += len(groups)
    window = {"t0": t0, "t1": min(time.time(), t1), "groups": in_window, "steps": steps}
    window["groups_per_s"] = in_window / max(1e-9, window["t1"] - t0)
    window["build_ms_per_group"] = (
        1e3 * statistics.median(build_s) / r.rollout_batch_size if build_s else None
    )
    # Drain: nothing new is admitted; whatever is out comes back (or the wait ends).
    pumping.cancel()
    await asyncio.gather(pumping, return_exceptions=True)
    deadline = time.monotonic() + 30
    while len(admission.in_flight) > buffer.ready and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    buffer.drop_leftovers()
    syncs = await weight_syncs(args, version) if args.syncs else []
    janitor.cancel()
    await asyncio.gather(janitor, return_exceptions=True)
    await buffer.stop()
    await redis.aclose()
    counts = vars(admission.counts)
    return {
        "window": window,
        "syncs": syncs,
        "counts": counts,
        "in_flight": len(admission.in_flight),
    }


async def weight_syncs(args: argparse.Namespace, version: int) -> list[dict[str, float]]:
    import torch

    from millstream.trainer.weights.sync import WeightSync

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        sync = WeightSync(
            args.router_url, transport="disk", disk_dir=Path(tmp), timeout_s=120,
            bucket_bytes=512 * 1024**2, pause_mode="abort",
        )  # fmt: skip
        tensors = [("w", torch.zeros(args.sync_tensor_bytes // 4))]
        try:
            for k in range(args.syncs):
                t0 = time.time()
                report = await sync.sync(tensors, version + 1 + k)
                if report.removed:
                    raise RuntimeError(f"a sync removed engines: {report.removed}")
                out.append({**report.seconds, "engines": len(report.engines), "t0": t0,
                            "t1": time.time()})  # fmt: skip
        finally:
            await sync.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--router-url", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=20.0, help="end of the window")
    parser.add_argument("--warmup", type=float, default=5.0, help="start of the window")
    parser.add_argument("--step-ms", type=float, default=0.0, help="a training step's stated cost")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--trim-interval", type=float, default=10.0)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--sync-tensor-bytes", type=int, default=1 << 20)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    result = asyncio.run(run(args, argv[cut + 1 :]))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
