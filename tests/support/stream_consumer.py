"""A stream consumer in its own process, for tests that kill or signal a real consumer.

python -m tests.support.stream_consumer hang URL STREAM GROUP NAME --count N
    reads N entries, prints "READ N", then sleeps without acking (to be SIGKILLed).
python -m tests.support.stream_consumer worker URL STREAM GROUP NAME --job-s S
    runs a StreamWorker (auto-ack) whose jobs print "START id" and sleep S seconds;
    SIGTERM drains it; it prints "STOPPED processed=K" on the way out.
"""

from __future__ import annotations

import argparse
import asyncio

from millstream.common.redis_conn import connect
from millstream.common.streams import Consumer, StreamEntry
from millstream.common.worker import StreamWorker


async def _hang(consumer: Consumer, count: int) -> None:
    entries: list[StreamEntry] = []
    while len(entries) < count:
        entries += await consumer.read(count - len(entries))
    print(f"READ {len(entries)}", flush=True)
    await asyncio.sleep(3600)


async def _work(consumer: Consumer, job_s: float, concurrency: int) -> None:
    async def handler(entry: StreamEntry) -> None:
        print(f"START {entry.id}", flush=True)
        await asyncio.sleep(job_s)

    worker = StreamWorker(
        consumer, handler, concurrency=concurrency, name="subprocess-worker", auto_ack=True
    )
    worker.install_signal_handlers()
    await worker.run()
    print(f"STOPPED processed={worker.processed}", flush=True)


async def main(args: argparse.Namespace) -> None:
    redis = await connect(args.redis_url)
    try:
        consumer = Consumer(
            redis,
            args.stream,
            args.group,
            args.name,
            claim_idle_ms=60_000,
            max_deliveries=5,
            dead_stream=f"{args.stream}:dead",
            block_ms=100,
        )
        await consumer.ensure_group()
        if args.mode == "hang":
            await _hang(consumer, args.count)
        else:
            await _work(consumer, args.job_s, args.concurrency)
    finally:
        await redis.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("hang", "worker"))
    parser.add_argument("redis_url")
    parser.add_argument("stream")
    parser.add_argument("group")
    parser.add_argument("name")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--job-s", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
