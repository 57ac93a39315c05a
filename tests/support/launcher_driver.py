"""Stand-in for `millstream train` around the LocalCluster, for the launcher's tests.

    python -m tests.support.launcher_driver --run-id R --run-dir D --hf-checkpoint M [flags]

Parses the run flags, starts the infra, publishes the run config with the URLs in it, starts
the workers, prints `READY {"urls": ..., "pids": {name: pid}}` and watches the children until
it is killed, interrupted (exit 130), terminated (exit 143) or a child dies (prints
`FAILED <message>`, exit 1). Children are stopped in `finally`, as the trainer does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import json
import signal
import sys

from millstream.common.config import parse_run_config
from millstream.common.config import store as config_store
from millstream.common.errors import MillstreamError
from millstream.common.redis_conn import connect
from millstream.launch.cluster import ClusterUrls, LocalCluster


async def start_all(cluster: LocalCluster) -> ClusterUrls:
    """What the trainer does: infra, then the run config (with the URLs) published, then workers."""
    urls = await cluster.start_infra()
    redis = await connect(urls.redis_url, cluster.redis_password)
    try:
        await config_store.publish(redis, urls.apply(cluster.cfg))
    finally:
        await redis.aclose()
    await cluster.start_workers()
    return urls


async def run(cluster: LocalCluster) -> None:
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM,
        asyncio.current_task().cancel,  # type: ignore[union-attr]
    )
    try:
        urls = await start_all(cluster)
        print("READY " + json.dumps({"urls": dataclasses.asdict(urls), "pids": cluster.pids}))
        sys.stdout.flush()
        await cluster.watch(interval_s=0.2)
    finally:
        cluster.stop()


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on a hang (the tests)
    # A test suite started in the background (`make test &`, nohup) hands its children SIGINT
    # ignored, and Python then leaves it so: the Ctrl-C test would wait forever.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = LocalCluster(parse_run_config(argv))
    try:
        asyncio.run(run(cluster))
    except MillstreamError as err:
        print(f"FAILED {err}", flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:
        return 143
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
