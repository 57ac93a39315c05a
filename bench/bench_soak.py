"""Soak: Redis memory and every process's RSS over a long `train-async` run, trimming on and off.

    .venv/bin/python bench/bench_soak.py [--minutes 4] [--every 10]

Runs the arith example (examples/arith/run.sh, the main job) twice, one run after the other,
each for `--minutes`: with the janitor as configured by default (--trim-interval 10), and with
trimming off (--trim-interval 1e9). Redis is started here, so its INFO can be read; the
trainer starts everything else. Every `--every` seconds it records Redis' used_memory, the
run's stream lengths and the RSS of the trainer and each of its children; at the end it
prints, per run, the value after the first minute, at the end, and their ratio. Flat is a
ratio near 1; the second run shows what the trimming buys.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proctree import children, name_of

ROOT = Path(__file__).resolve().parents[1]
STREAMS = ("prompts", "generated", "scored", "dead")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def soak(label: str, minutes: float, every_s: float, trim_interval: str, workdir: Path) -> dict:
    port = free_port()
    data = workdir / label / "redis"
    data.mkdir(parents=True)
    server = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--dir", str(data), "--save", "", "--appendonly", "no",
         "--maxmemory-policy", "noeviction"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.1)
    run_dir = workdir / label / "run"
    env = {**os.environ, "RUN_DIR": str(run_dir), "NUM_ROLLOUT": "1000000"}
    log = (workdir / label / "trainer.log").open("w")
    trainer = subprocess.Popen(
        ["bash", str(ROOT / "examples/arith/run.sh"), "--redis-url", url, "--run-id", "soak",
         "--trim-interval", trim_interval, "--save-interval", "1000000"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    samples: list[tuple[float, float, dict[str, int], dict[str, float]]] = []
    start = time.monotonic()
    try:
        while time.monotonic() - start < minutes * 60:
            time.sleep(every_s)
            if trainer.poll() is not None:
                raise SystemExit(f"{label}: the run ended early; see {log.name}")
            used = int(client.info("memory")["used_memory"]) / 2**20
            lengths = {s: int(client.xlen(f"soak:{s}")) for s in STREAMS}
            procs = {"redis-server": rss_mb(server.pid) or 0.0}
            for pid in children(trainer.pid):
                name, mb = name_of(pid), rss_mb(pid)
                if mb is not None and name not in ("bash", "run.sh"):
                    procs[name] = procs.get(name, 0.0) + mb
            samples.append((time.monotonic() - start, used, lengths, procs))
            print(
                f"[{label}] {samples[-1][0]:5.0f}s redis {used:6.1f} MB, streams "
                + " ".join(f"{s}={n}" for s, n in lengths.items()),
                flush=True,
            )
    finally:
        os.killpg(trainer.pid, signal.SIGTERM)
        try:
            trainer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
        log.close()
        client.close()
        server.terminate()
        server.wait()
    return {"label": label, "samples": samples}


def summarize(run: dict) -> list[tuple[str, str, str, str]]:
    samples = run["samples"]
    first = next((s for s in samples if s[0] >= 60), samples[0])  # after warm-up
    last = samples[-1]
    rows = [("redis used_memory (MB)", first[1], last[1])]
    rows += [(f"stream {s} (entries)", first[2][s], last[2][s]) for s in STREAMS]
    for name in sorted(last[3]):
        if name in first[3]:
            rows.append((f"RSS {name} (MB)", first[3][name], last[3][name]))
    return [(what, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}" if a else "-") for what, a, b in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=4.0)
    parser.add_argument("--every", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="millstream-soak-") as tmp:
        runs = [
            soak("trim on", args.minutes, args.every, "10", Path(tmp)),
            soak("trim off", args.minutes, args.every, "1e9", Path(tmp)),
        ]
    for run in runs:
        t0 = next((s[0] for s in run["samples"] if s[0] >= 60), run["samples"][0][0])
        t1 = run["samples"][-1][0]
        print(f"\n{run['label']}: at {t0:.0f}s vs at {t1:.0f}s of train-async (arith example)")
        print(f"| {'what':<28} | {'start':>9} | {'end':>9} | {'end/start':>9} |")
        print(f"|{'-' * 30}|{'-' * 11}|{'-' * 11}|{'-' * 11}|")
        for what, a, b, ratio in summarize(run):
            print(f"| {what:<28} | {a:>9} | {b:>9} | {ratio:>9} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
