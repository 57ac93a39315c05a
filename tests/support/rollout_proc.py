"""Rollout workers as real processes, and stream helpers for their tests.

    procs = RolloutProcs(redis_url, run_id, tmp_path)
    procs.start("r1"); procs.wait_ready("r1")      # ready once its heartbeat key exists
    procs.kill("r1")                               # SIGKILL, as a crash would
    procs.stop("r1")                               # SIGTERM: drain, exit 0

    with RouterAnswering(500) as router: ...       # a router whose every /generate fails

Integration tests generate through the real router and engine; `RouterAnswering` stands in
only for a failure those cannot be made to produce on demand. The unit tests' in-process fake
engine answers with `fake_answer`: its greedy token at absolute position p is `token_at(p)`, so
resuming a sequence anywhere continues it exactly, as a real greedy model under fixed weights
would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from millstream.common.streams import entry_fields
from tests.support.worker_procs import WorkerProcs


def token_at(position: int) -> int:
    return position % 97 + 10


def logprob_at(position: int) -> float:
    return -0.05 - (position % 5) / 10


def fake_answer(body: dict[str, Any], version: str, abort_after: int | None = None) -> dict:
    """SGLang's /generate answer from the fake greedy model; aborted after `abort_after`
    tokens when given and the budget is larger."""
    start, budget = len(body["input_ids"]), body["sampling_params"]["max_new_tokens"]
    count, finish = budget, "length"
    if abort_after is not None and abort_after < budget:
        count, finish = abort_after, "abort"
    positions = range(start, start + count)
    return {
        "text": "".join(chr(97 + token_at(p) % 26) for p in positions),
        "output_ids": [token_at(p) for p in positions],
        "meta_info": {
            "finish_reason": {"type": finish},
            "prompt_tokens": start,
            "completion_tokens": count,
            "output_token_logprobs": [[logprob_at(p), token_at(p), None] for p in positions],
            "weight_version": version,
        },
    }


class RouterAnswering:
    """A router whose every /generate answers `status` (a failure the real router does not
    produce on demand): a small HTTP/1.1 peer on loopback, in its own thread. Records every
    request as (method, path, headers, JSON body).
    """

    def __init__(self, status: int):
        self.status = status
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="router-answering", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RouterAnswering:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the stand-in router did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0)
        )
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            tasks = asyncio.all_tasks(self._loop)
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(server.wait_closed())
            self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while line := await reader.readline():
                method, path, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                body = json.loads(raw) if raw else None
                self.requests.append((method, path, headers, body))
                status, payload = self._answer(path, body)
                data = json.dumps(payload).encode()
                writer.write(
                    f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def _answer(self, path: str, body: Any) -> tuple[int, Any]:
        if path.startswith("/generate"):
            return self.status, {"error": {"message": f"scripted {self.status}"}}
        return 404, {"error": {"message": f"no route {path}"}}

    def generate_requests(self) -> list[tuple[dict[str, str], dict]]:
        return [(h, b) for _m, p, h, b in list(self.requests) if p.startswith("/generate")]


class RolloutProcs(WorkerProcs):
    """`millstream rollout` processes of one run, each logging to `{log_dir}/{name}.log`."""

    def start(self, name: str, *extra: str) -> subprocess.Popen:
        flags = ["--consumer-name", name, "--run-dir", str(self.log_dir)]
        return self.spawn("rollout", name, [*flags, *extra])

    def wait_ready(self, name: str, timeout_s: float = 30.0) -> None:
        self.wait_beating("rollout", name, timeout_s)


def publish_prompts(
    redis_url: str, stream: str, groups: Sequence[Any], trace_fields: dict | None = None
) -> None:
    """XADD each message to `stream` in the wire envelope (sync client, for test bodies)."""
    client = redis.Redis.from_url(redis_url)
    try:
        for group in groups:
            client.xadd(stream, entry_fields(group, trace_fields))
    finally:
        client.close()


def read_stream(
    redis_url: str, stream: str, message_type: type, n: int, timeout_s: float, settle_s=0.3
) -> list[tuple[Any, dict[bytes, bytes]]]:
    """Every entry of `stream` once it has `n` (or at the timeout), decoded; waits `settle_s`
    more so that a duplicate would show up."""
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while client.xlen(stream) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(settle_s)
        return [
            (message_type.FromString(fields[b"data"]), fields)
            for _id, fields in client.xrange(stream)
        ]
    finally:
        client.close()


def pending_count(redis_url: str, stream: str, group: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        with contextlib.suppress(redis.ResponseError):
            return int(client.xpending(stream, group)["pending"])
        return 0
    finally:
        client.close()
