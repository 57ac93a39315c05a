"""Engine throughput vs naive one-request-at-a-time HF generate(), side by side in one run.

    .venv/bin/python bench/bench_engine.py [--new-tokens 64] [--hidden 256] [--layers 4]

Builds a random Qwen2 model (hidden 256, 4 layers, the tests' byte-level tokenizer) in a
temp dir, measures HF `model.generate()` one request at a time (greedy, exactly
--new-tokens tokens each), then starts `millstream engine` on the same directory and sends
the same kind of request over HTTP from 1, 8 and 32 concurrent clients (ignore_eos, greedy).
Prints output tokens/s and the ratio to the naive baseline. Both sides run on the same
machine, one after the other, so the ratio is what to read; absolute numbers depend on
the machine and its load.

Second table, a GRPO rollout's shape: a burst of 16 requests with n = 8 (temperature 1,
--burst-new-tokens each) sent at once over HTTP, against one batched HF `generate()` of the
same 128 rows in process: the engine must batch across requests (one padded prefill per
step, each prompt prefilled once for its 8 copies, one decode over all rows) to keep up.
Both sides use --threads compute threads.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(count)]


def naive_generate(model_dir: Path, batch: list[list[int]], new_tokens: int) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([batch[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        produced = 0
        for prompt in batch:
            ids_BT = torch.tensor([prompt])
            out = model.generate(
                ids_BT,
                attention_mask=torch.ones_like(ids_BT),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
            produced += out.shape[1] - ids_BT.shape[1]
    return produced, time.perf_counter() - start


async def engine_run(
    url: str, batch: list[list[int]], new_tokens: int, concurrency: int
) -> tuple[int, float]:
    import httpx

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in batch:
        queue.put_nowait(prompt)
    produced = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal produced
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": new_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
            resp = await http.post(f"{url}/generate", json=body)
            resp.raise_for_status()
            produced += resp.json()["meta_info"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await client_warmup(http, url)
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return produced, time.perf_counter() - start


def hf_burst(model_dir: Path, batch: list[list[int]], n: int, new_tokens: int) -> float:
    """Median seconds of one batched HF generate() of every prompt n times (sampled)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    ids_BT = torch.tensor([p for p in batch for _ in range(n)])
    times = []
    with torch.inference_mode():
        for _ in range(6):
            start = time.perf_counter()
            model.generate(
                ids_BT,
                attention_mask=torch.ones_like(ids_BT),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                top_k=0,
            )
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def engine_burst(url: str, batch: list[list[int]], n: int, new_tokens: int) -> float:
    """Median seconds until all of `batch` (each with n samples) came back over HTTP."""
    import httpx

    body = {"sampling_params": {"max_new_tokens": new_tokens, "n": n, "ignore_eos": True}}
    limits = httpx.Limits(max_connections=len(batch) + 4, max_keepalive_connections=len(batch))
    times = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await client_warmup(http, url)
        for _ in range(6):
            start = time.perf_counter()
            responses = await asyncio.gather(
                *(http.post(f"{url}/generate", json={"input_ids": p, **body}) for p in batch)
            )
            for resp in responses:
                resp.raise_for_status()
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def client_warmup(http, url: str) -> None:
    body = {"input_ids": [65, 66], "sampling_params": {"max_new_tokens": 4}}
    (await http.post(f"{url}/generate", json=body)).raise_for_status()


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--naive-requests", type=int, default=8)
    parser.add_argument("--burst-new-tokens", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    from tests.support.engine_proc import EngineProcess
    from tests.support.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
        )
        print(
            f"model: Qwen2 hidden {args.hidden}, {args.layers} layers; "
            f"{args.prompt_tokens} prompt + {args.new_tokens} output tokens per request"
        )
        naive = prompts(args.naive_requests, args.prompt_tokens, seed=1)
        n_tokens, seconds = naive_generate(model_dir, naive, args.new_tokens)
        rows = [("HF generate(), one at a time", 1, len(naive), n_tokens, seconds)]
        burst = prompts(16, 8, seed=99)
        hf_burst_s = hf_burst(model_dir, burst, 8, args.burst_new_tokens)
        engine = EngineProcess(
            model_dir,
            Path(tmp),
            "--max-running-requests",
            "128",
            "--num-threads",
            str(args.threads),
        )
        try:
            for concurrency in (1, 8, 32):
                count = max(8, 2 * concurrency)
                batch = prompts(count, args.prompt_tokens, seed=concurrency)
                n_tokens, seconds = asyncio.run(
                    engine_run(engine.url, batch, args.new_tokens, concurrency)
                )
                rows.append(("millstream engine (HTTP)", concurrency, count, n_tokens, seconds))
            engine_burst_s = asyncio.run(engine_burst(engine.url, burst, 8, args.burst_new_tokens))
        finally:
            engine.stop()

    base = rows[0][3] / rows[0][4]
    header = f"{'system':<30} {'conc':>5} {'reqs':>5} {'tokens':>7} {'secs':>7} {'tok/s':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for name, conc, reqs, n_tokens, seconds in rows:
        rate = n_tokens / seconds
        print(
            f"{name:<30} {conc:>5} {reqs:>5} {n_tokens:>7} {seconds:>7.2f} {rate:>8.1f} {rate / base:>5.2f}x"
        )
    rows_burst = 16 * 8
    print(f"\nburst: 16 requests x n=8 = {rows_burst} rows, {args.burst_new_tokens} new tokens")
    print(f"{'system':<44} {'median s':>9} {'rows/s':>8} {'ratio':>6}")
    for name, seconds in (
        ("HF generate(), 128 rows in one batch", hf_burst_s),
        ("millstream engine, 16 HTTP requests with n=8", engine_burst_s),
    ):
        print(
            f"{name:<44} {seconds:>9.4f} {rows_burst / seconds:>8.0f} {hf_burst_s / seconds:>5.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
