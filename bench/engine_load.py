"""The load bench/bench_engine.py puts on an engine over HTTP: SGLang's `/generate`, which
millstream's engine and a real SGLang server both answer, so one client measures either.

Every request carries `input_ids` (no tokenizer on the client's side), `ignore_eos` and a fixed
`max_new_tokens`, so that two engines on the same model generate the same number of tokens and a
difference in time is a difference in serving them. Each call returns what it counted (the
completion tokens the engine reported) beside what it timed, so that a bench can check both
engines did the same work before it compares their speed.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any


def prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` printable byte tokens (the tests' byte-level tokenizer)."""
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(count)]


@dataclass
class Load:
    """What one row of load did: completion tokens reported, wall seconds from the first
    request sent to the last answer, each request's seconds, and the samples whose log-probs
    did not cover every token (with return_logprob; 0 otherwise)."""

    tokens: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    short_logprobs: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def sampling(new_tokens: int, temperature: float, n: int = 1) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": new_tokens,
        "temperature": temperature,
        "ignore_eos": True,
    }
    if n > 1:
        params["n"] = n
    return params


async def client_warmup(http, url: str) -> None:
    body = {"input_ids": [65, 66], "sampling_params": {"max_new_tokens": 4}}
    (await http.post(f"{url}/generate", json=body)).raise_for_status()


async def engine_run(
    url: str,
    batch: list[list[int]],
    new_tokens: int,
    concurrency: int,
    temperature: float = 0.0,
) -> Load:
    """`batch` served by `concurrency` clients, each sending its next prompt when its last
    answer came back (a closed loop: the engine always holds `concurrency` requests)."""
    import httpx

    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in batch:
        queue.put_nowait(prompt)
    load = Load(0, 0.0)

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"input_ids": prompt, "sampling_params": sampling(new_tokens, temperature)}
            sent = time.perf_counter()
            resp = await http.post(f"{url}/generate", json=body)
            resp.raise_for_status()
            load.latencies.append(time.perf_counter() - sent)
            load.tokens += resp.json()["meta_info"]["completion_tokens"]

    # Each client keeps its connection (httpx keeps 20 by default: the other 44 of 64 clients
    # would connect again for every request); it sends its next request as the last answer
    # comes back, never idle long enough for the server to close it.
    limits = httpx.Limits(
        max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4
    )
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await client_warmup(http, url)
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        load.seconds = time.perf_counter() - start
    return load


async def burst(url: str, batch: list[list[int]], n: int, new_tokens: int) -> Load:
    """A GRPO rollout's shape: every prompt of `batch` sent at once, each asking for `n`
    samples at temperature 1 with their log-probs (return_logprob, as a trainer asks).
    A request's latency is until all of its n samples are back."""
    import httpx

    params = sampling(new_tokens, 1.0, n)
    # A connection of its own for every request, closed after its answer: one handed back to
    # the pool and picked up again as the server closes it idle (uvicorn's keep-alive timeout)
    # fails with httpx.ReadError, which ended 2 of the first 20 bursts of 512 requests here.
    limits = httpx.Limits(max_connections=len(batch) + 4, max_keepalive_connections=0)
    load = Load(0, 0.0)

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        sent = time.perf_counter()
        resp = await http.post(f"{url}/generate", json=body)
        resp.raise_for_status()
        load.latencies.append(time.perf_counter() - sent)
        answers = resp.json()
        for answer in answers if isinstance(answers, list) else [answers]:
            meta = answer["meta_info"]
            load.tokens += meta["completion_tokens"]
            if len(meta.get("output_token_logprobs") or []) != meta["completion_tokens"]:
                load.short_logprobs += 1

    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await client_warmup(http, url)
        start = time.perf_counter()
        await asyncio.gather(*(one(http, p) for p in batch))
        load.seconds = time.perf_counter() - start
    return load
