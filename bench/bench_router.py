"""What the router costs: added latency (p50/p99) and max requests/s, against the engine direct.

    .venv/bin/python bench/bench_router.py [--model-path DIR] [--sglang-router-python PY]

One run, one machine, loopback: a `millstream engine` on a tiny model, a `millstream router`
in front of it, and (when it is installed) sglang-router in front of the same engine as a
peer. Two endpoints: `GET /get_model_info` (no model work: pure proxy overhead) and `POST
/generate` with max_new_tokens=1 (a real, short request). Latency is measured one request at
a time; throughput with `--concurrency` requests in flight. The client is a minimal
keep-alive HTTP/1.1 client on asyncio, the same for every target, so differences are the
servers'. On a 2-core machine the client, router and engine share the cores: read ratios,
not absolute numbers.

sglang-router (a Rust binary on PyPI) installs without torch (its wheel needs only aiohttp,
orjson, fastapi, uvicorn, setproctitle), best into a venv of its own:
    python3 -m venv /tmp/sgr && /tmp/sgr/bin/pip install sglang-router
    .venv/bin/python bench/bench_router.py --sglang-router-python /tmp/sgr/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.redis_server import free_port  # noqa: E402

GENERATE = json.dumps(
    {"input_ids": [11, 12, 13, 14, 15, 16, 17, 18], "sampling_params": {"max_new_tokens": 1}}
).encode()


class Conn:
    """One keep-alive HTTP/1.1 connection; reads Content-Length and chunked bodies."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + body)
        status_line = await self.reader.readline()
        status = int(status_line.split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
        else:
            data = b""
            while size := int((await self.reader.readline()).strip(), 16):
                data += await self.reader.readexactly(size)
                await self.reader.readline()
            await self.reader.readline()
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            self.reader = self.writer = None


@dataclass
class Result:
    p50_ms: float
    p99_ms: float
    rps: float
    errors: int
    first_error: str = ""


async def measure(
    port: int, method: str, path: str, body: bytes, n_lat: int, n_rps: int, conc: int
) -> Result:
    errors, first_error = 0, ""

    def check(status: int, data: bytes) -> None:
        nonlocal errors, first_error
        if status != 200:
            errors += 1
            first_error = first_error or f"HTTP {status}: {data[:300].decode(errors='replace')}"

    conn = Conn("127.0.0.1", port)
    for _ in range(20):  # warm-up: connections, caches, JITs
        check(*await conn.request(method, path, body))
    if errors == 20:  # this target cannot serve this endpoint: do not time its errors
        await conn.close()
        return Result(float("nan"), float("nan"), float("nan"), errors, first_error)
    lat = []
    for _ in range(n_lat):
        t0 = time.perf_counter()
        status, data = await conn.request(method, path, body)
        lat.append(time.perf_counter() - t0)
        check(status, data)
    await conn.close()
    lat.sort()

    conns = [Conn("127.0.0.1", port) for _ in range(conc)]
    remaining = n_rps

    async def worker(c: Conn) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            check(*await c.request(method, path, body))

    await asyncio.gather(*(c.request(method, path, body) for c in conns))  # open them all
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - t0
    for c in conns:
        await c.close()
    return Result(
        p50_ms=statistics.median(lat) * 1e3,
        p99_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3,
        rps=n_rps / elapsed,
        errors=errors,
        first_error=first_error,
    )


class Proc:
    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait(self, port: int, path: str, timeout_s: float = 180) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[:4]} exited; see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.proc.args[:4]} not ready in {timeout_s}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def find_sglang_router(explicit: str | None) -> tuple[str | None, str]:
    """(python that can run sglang_router, why not when None)."""
    candidates = [explicit, os.environ.get("SGLANG_ROUTER_PYTHON"), sys.executable]
    for py in [c for c in candidates if c]:
        if not shutil.which(py) and not Path(py).exists():
            continue
        ok = subprocess.run([py, "-c", "import sglang_router"], capture_output=True).returncode == 0
        if ok:
            return py, ""
    return None, (
        "sglang-router: not installed here. It installs without torch (deps: aiohttp, orjson, "
        "fastapi, uvicorn, setproctitle): `python3 -m venv /tmp/sgr && /tmp/sgr/bin/pip install "
        "sglang-router`, then pass --sglang-router-python /tmp/sgr/bin/python."
    )


def start_servers(args, model: str | None, tmp: Path, procs: list[Proc]) -> tuple[list, list[str]]:
    """Engine (unless --engine-url), our router and sglang-router; ([(name, port)], notes)."""
    cli = [sys.executable, "-m", "millstream.cli"]
    notes: list[str] = []
    if args.engine_url:
        e_port = int(args.engine_url.rstrip("/").rsplit(":", 1)[1])
    else:
        e_port = free_port()
        argv = [*cli, "engine", "--model-path", str(model), "--port", str(e_port)]
        # One torch thread: on a small machine, torch's spinning threads would otherwise fight
        # the client and the router for cores, and the table would measure that fight.
        env = {"OMP_NUM_THREADS": str(args.engine_threads)}
        procs.append(Proc([*argv, "--log-level", "warning"], tmp / "engine.log", env=env))
        procs[-1].wait(e_port, "/health")
    engine_url = f"http://127.0.0.1:{e_port}"
    r_port = free_port()
    argv = [*cli, "router", "--port", str(r_port), "--worker-urls", engine_url]
    procs.append(Proc([*argv, "--log-level", "warning"], tmp / "router.log"))
    procs[-1].wait(r_port, "/get_model_info")
    targets = [("engine direct", e_port), ("millstream router", r_port)]

    sgr_python, why_not = find_sglang_router(args.sglang_router_python)
    if sgr_python and model is None:
        why_not = "sglang-router: skipped, it needs --model-path (else it fetches a tokenizer from the hub)"
    if sgr_python and not why_not:
        s_port = free_port()
        argv = [sgr_python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        argv += ["--port", str(s_port), "--worker-urls", engine_url, "--policy", "round_robin"]
        argv += ["--tokenizer-path", str(model), "--prometheus-port", str(free_port())]
        procs.append(Proc([*argv, "--log-level", "warn"], tmp / "sglang-router.log"))
        try:
            procs[-1].wait(s_port, "/get_model_info", timeout_s=60)
            targets.append(("sglang-router", s_port))
            notes.append(
                "sglang-router: same engine, --policy round_robin (one worker: policy moot)."
            )
        except RuntimeError as err:
            why_not = f"sglang-router: installed but did not serve ({err})"
    if why_not:
        notes.append(why_not)
    return targets, notes


def print_table(rows: list, args, notes: list[str]) -> None:
    print(
        f"\nrouter overhead on loopback ({os.cpu_count()} cores; latency: 1 in flight, "
        f"{args.latency_requests} requests; req/s: {args.concurrency} in flight; "
        f"engine with {args.engine_threads} torch thread(s))\n"
    )
    header = (
        f"{'endpoint':<26} {'target':<18} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} "
        f"{'+p99 ms':>8} {'req/s':>8} {'req/s vs direct':>16} {'errors':>6}"
    )
    print(header)
    print("-" * len(header))
    base: dict[str, Result] = {}
    for label, name, res in rows:
        if name == "engine direct":
            base[label] = res
        b = base[label]
        print(
            f"{label:<26} {name:<18} {res.p50_ms:>8.2f} {res.p99_ms:>8.2f} "
            f"{res.p50_ms - b.p50_ms:>8.2f} {res.p99_ms - b.p99_ms:>8.2f} {res.rps:>8.0f} "
            f"{res.rps / b.rps:>16.2f} {res.errors:>6}"
        )
    print()
    for label, name, res in rows:
        if res.errors:
            notes.append(f"{name} on {label}: {res.errors} errors, the first: {res.first_error}")
    for note in notes:
        print(note)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", help="tiny HF model dir (default: build one in a temp dir)")
    ap.add_argument("--engine-url", help="an engine already running (default: start one)")
    ap.add_argument("--sglang-router-python", help="a python with sglang-router installed")
    ap.add_argument("--latency-requests", type=int, default=300)
    ap.add_argument("--rps-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--engine-threads", type=int, default=1, help="OMP_NUM_THREADS of the engine")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    model = args.model_path
    if model is None and args.engine_url is None:
        model = str(tmp / "model")
        code = f"from tests.support.tiny_model import build_tiny_model; build_tiny_model({model!r})"
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    endpoints = [
        ("GET /get_model_info", "GET", "/get_model_info", b"", args.rps_requests),
        ("POST /generate (1 token)", "POST", "/generate", GENERATE, args.rps_requests // 4),
    ]
    procs: list[Proc] = []
    rows = []
    try:
        targets, notes = start_servers(args, model, tmp, procs)
        for label, method, path, body, n_rps in endpoints:
            for name, port in targets:
                lat_n, conc = args.latency_requests, args.concurrency
                res = asyncio.run(measure(port, method, path, body, lat_n, n_rps, conc))
                rows.append((label, name, res))
    finally:
        for p in reversed(procs):
            p.stop()
    print_table(rows, args, notes)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
