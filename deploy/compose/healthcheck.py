"""Container health checks for compose (exit 0: healthy).

    python /app/healthcheck.py http URL                 an HTTP endpoint answers 200
    python /app/healthcheck.py heartbeat KIND           this container's KIND worker beats
                                                        ({run}:workers:KIND:KIND-HOSTNAME-*)
The heartbeat check reads MILLSTREAM_REDIS_URL and MILLSTREAM_RUN_ID from the environment.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request


def http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200
    except OSError:
        return False


def heartbeat(kind: str) -> bool:
    import redis

    client = redis.Redis.from_url(
        os.environ["MILLSTREAM_REDIS_URL"],
        password=os.environ.get("REDIS_PASSWORD") or None,
        socket_timeout=3,
    )
    pattern = f"{os.environ['MILLSTREAM_RUN_ID']}:workers:{kind}:{kind}-{socket.gethostname()}-*"
    try:
        return any(True for _ in client.scan_iter(match=pattern, count=1000))
    except redis.RedisError:
        return False


if __name__ == "__main__":
    check, arg = sys.argv[1], sys.argv[2]
    sys.exit(0 if {"http": http, "heartbeat": heartbeat}[check](arg) else 1)
