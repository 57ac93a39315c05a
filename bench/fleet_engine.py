"""A simulated fleet: N engines that speak SGLang's HTTP API, no model, one process, one port each.

    .venv/bin/python bench/fleet_engine.py --engines 64 --urls-file /tmp/urls.json [model flags]

Each engine is a small HTTP/1.1 server on asyncio (keep-alive, Content-Length bodies), all on
one event loop. What it answers is what millstream's router, rollout worker and weight sync
call (the same paths and shapes as SGLang's server and millstream's engine):

    GET  /health /health_generate                     200
    GET  /get_model_info /model_info                   weight_version, model_path, vocab_size...
    GET  /get_server_info /server_info                 tp_size, dp_size, placement, weight_transports
    GET  /get_weight_version                           {"weight_version": ...}
    POST /generate                                     SGLang's answer(s): text, output_ids, meta_info
                                                       with output_token_logprobs and weight_version;
                                                       one prompt or a batch, `n` samples each
    POST /pause_generation {mode}                      new requests wait; mode abort ends the
                                                       running ones at once (finish_reason abort)
    POST /continue_generation /flush_cache /abort_request
    POST /update_weights_from_disk /update_weights_from_tensor
                                                       sleeps the modeled transfer, then takes
                                                       `weight_version`
    GET  /fleet_stats                                  this engine's counters (the bench's own)

The update-group calls (/init_weights_update_group, ...) answer success false: a simulated
engine joins no process group, so the trainer is given `--update-weight-transport disk` (or an
engine on its machine takes `tensor`).

Latency model (all zero by default: infinitely fast engines, the control plane's own ceiling):

    a request of P prompt tokens and n samples of T new tokens each, with R sequences already
    running on the engine, takes
        overhead + prefill_per_token * P * n_prompts + T * (decode_step + decode_per_seq * (R + s))
    where s is the request's own sequences: every decode step makes one token for every running
    sequence, and a step gets slower as the batch grows (the batch effect, linear in its size).
    An update call takes transfer_bytes / bandwidth (a pipelined broadcast delivers every byte
    to every receiver in about that time, whatever their number).

Every sample is exactly T tokens (EOS ignored: finish_reason length). Token ids are drawn
uniformly from `vocab_size` (3-byte varints for a 152k vocabulary, a little more than real
text's skew to small ids), logprobs are float32 values written as Python floats (as SGLang's
JSON has them), and the text is word-like, `text_bytes_per_token` ASCII bytes a token. An
answer's JSON is built once per (T, version, sample index) and reused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SENTINEL = -987654321  # stands in for prompt_tokens in a cached answer, replaced per request


@dataclass(frozen=True)
class LatencyModel:
    overhead_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_step_s: float = 0.0
    decode_per_seq_s: float = 0.0
    transfer_bytes: int = 0
    bandwidth_bytes_s: float = 25e9

    def generation_s(self, prompt_tokens: int, new_tokens: int, running: int, own: int) -> float:
        step = self.decode_step_s + self.decode_per_seq_s * (running + own)
        return self.overhead_s + self.prefill_s_per_token * prompt_tokens + new_tokens * step

    def update_s(self) -> float:
        return self.transfer_bytes / self.bandwidth_bytes_s if self.transfer_bytes else 0.0

    def describe(self) -> str:
        if not (self.overhead_s or self.prefill_s_per_token or self.decode_step_s):
            gen = "infinitely fast generation (answers at once)"
        else:
            gen = (
                f"overhead {self.overhead_s * 1e3:g} ms + prefill {self.prefill_s_per_token * 1e6:g}"
                f" us/token + T x ({self.decode_step_s * 1e3:g} ms + "
                f"{self.decode_per_seq_s * 1e6:g} us x running sequences) a request"
            )
        moved = (
            f"; a weight update moves {self.transfer_bytes / 1e9:g} GB at "
            f"{self.bandwidth_bytes_s / 1e9:g} GB/s = {self.update_s():.2f} s"
            if self.transfer_bytes
            else "; weight updates instant"
        )
        return gen + moved


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


SYLLABLES = [
    "the",
    "an",
    "ing",
    "er",
    "re",
    "on",
    "at",
    "en",
    "es",
    "or",
    "ti",
    "is",
    "al",
    "it",
    "ar",
    "st",
    "to",
    "nt",
    "ed",
    "nd",
    "ou",
    "ea",
    "ha",
    "he",
    "in",
]


@functools.cache
def words(count: int = 8192) -> list[str]:
    """`count` word-like strings of one to three syllables: the text a token stands for."""
    rng = random.Random(7)
    return [
        "".join(rng.choice(SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3))))
        for _ in range(count)
    ]


class Answers:
    """SGLang's per-sample answer JSON, cached; `prompt_tokens` is filled in per request.

    Each sample draws its tokens uniformly from the vocabulary, its logprobs from an
    exponential (float32, as an engine's are: their mantissas are noise to a compressor) and
    its text as one word-like piece a token, padded or cut to `text_bytes_per_token` bytes on
    average: data that compresses about as well as real output does."""

    def __init__(self, vocab_size: int, text_bytes_per_token: int = 4):
        self.vocab_size = vocab_size
        self.text_bytes_per_token = text_bytes_per_token

    @functools.lru_cache(maxsize=512)  # noqa: B019 - one Answers per process, kept for its life
    def sample(self, new_tokens: int, version: str, index: int, finish: str) -> tuple[bytes, bytes]:
        rng = random.Random(index * 1_000_003 + new_tokens)
        ids = [rng.randrange(self.vocab_size) for _ in range(new_tokens)]
        lps = [_f32(-rng.expovariate(1.5)) for _ in range(new_tokens)]
        vocabulary = words()
        text = " ".join(vocabulary[t % len(vocabulary)] for t in ids)
        text = (text * (1 + self.text_bytes_per_token * new_tokens // max(1, len(text))))[
            : self.text_bytes_per_token * new_tokens
        ]
        answer = {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": f"sim-{index}",
                "finish_reason": {"type": finish, "length": new_tokens}
                if finish == "length"
                else {"type": finish},
                "prompt_tokens": SENTINEL,
                "completion_tokens": new_tokens,
                "cached_tokens": 0,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
                "weight_version": version,
            },
        }
        head, tail = (
            json.dumps(answer, separators=(",", ":")).encode().split(str(SENTINEL).encode())
        )
        return head, tail

    def one(self, prompt_tokens: int, new_tokens: int, version: str, index: int, finish: str):
        head, tail = self.sample(new_tokens, version, index, finish)
        return head + str(prompt_tokens).encode() + tail


class BadRequest(Exception):
    pass


def _items(body: dict[str, Any]) -> tuple[list[tuple[int, int, int]], bool]:
    """[(prompt tokens, new tokens, n)] per prompt, and whether the answer is a list."""
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids: a list of token ids (or a list of them) is required")
    params = body.get("sampling_params") or {}
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    per = params if isinstance(params, list) else [params] * len(prompts)
    if len(per) != len(prompts):
        raise BadRequest(f"{len(prompts)} prompts but {len(per)} sampling_params")
    items = [
        (len(p), int(sp.get("max_new_tokens", 128)), int(sp.get("n") or 1))
        for p, sp in zip(prompts, per, strict=True)
    ]
    return items, batch or items[0][2] > 1


@dataclass
class Stats:
    requests: int = 0
    sequences: int = 0
    tokens: int = 0
    updates: int = 0
    pauses: int = 0
    aborted: int = 0


class SimEngine:
    """One simulated engine's state and routes (module docstring)."""

    def __init__(self, model: LatencyModel, answers: Answers, placement_host: str, name: str):
        self.model, self.answers, self.name = model, answers, name
        self.placement_host = placement_host
        self.weight_version = "0"
        self.running = 0
        self.stats = Stats()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._abort = asyncio.Event()
        self.url = ""

    # -- generation -------------------------------------------------------------------------

    async def generate(self, body: dict[str, Any]) -> bytes:
        items, as_list = _items(body)
        await self._resumed.wait()  # paused: queued until /continue_generation
        seqs = sum(n for _, _, n in items)
        longest = max(t for _, t, _ in items)
        prompt = sum(p for p, _, _ in items)
        duration = self.model.generation_s(prompt, longest, self.running, seqs)
        done_frac, finish = 1.0, "length"
        if duration > 0:
            self.running += seqs
            start = time.monotonic()
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(duration):
                        await self._abort.wait()
                    done_frac, finish = (time.monotonic() - start) / duration, "abort"
            finally:
                self.running -= seqs
        version = self.weight_version
        parts = []
        for p, t, n in items:
            made = t if finish == "length" else int(t * done_frac)
            for j in range(n):
                parts.append(self.answers.one(p, made, version, j, finish))
                self.stats.tokens += made
        self.stats.requests += 1
        self.stats.sequences += seqs
        if finish == "abort":
            self.stats.aborted += seqs
        return b"[" + b",".join(parts) + b"]" if as_list else parts[0]

    # -- control ----------------------------------------------------------------------------

    def pause(self, mode: str) -> None:
        self.stats.pauses += 1
        self._resumed.clear()
        if mode == "abort":
            self._abort.set()
            self._abort = asyncio.Event()

    def resume(self) -> None:
        self._resumed.set()

    async def update(self, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(self.model.update_s())
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        self.stats.updates += 1
        return {"success": True, "message": f"updated; weight_version {self.weight_version}"}

    def info(self) -> dict[str, Any]:
        return {
            "model_path": "simulated",
            "tokenizer_path": "simulated",
            "served_model_name": "simulated",
            "is_generation": True,
            "weight_version": self.weight_version,
            "vocab_size": self.answers.vocab_size,
            "context_length": 1 << 20,
        }

    def server_info(self) -> dict[str, Any]:
        return {
            **self.info(),
            "version": "fleet-sim",
            "tp_size": 1,
            "dp_size": 1,
            "placement": {"host": self.placement_host, "device": "cpu", "gpu_uuid": None},
            "weight_transports": ["tensor", "disk"],
            "running_requests": self.running,
        }

    async def route(self, method: str, path: str, raw: bytes) -> tuple[int, bytes]:
        path = path.split("?", 1)[0]
        body = json.loads(raw) if raw.strip() else {}
        if method == "GET" and path in ("/health", "/health_generate"):
            return 200, b""
        if method == "GET" and path in ("/get_model_info", "/model_info"):
            return _ok(self.info())
        if method == "GET" and path in ("/get_server_info", "/server_info"):
            return _ok(self.server_info())
        if method == "GET" and path == "/get_weight_version":
            return _ok({"weight_version": self.weight_version})
        if method == "GET" and path == "/fleet_stats":
            return _ok({**vars(self.stats), "weight_version": self.weight_version})
        if method != "POST" and path != "/flush_cache":
            return _error(404, f"no route {method} {path}")
        if path == "/generate":
            try:
                return 200, await self.generate(body)
            except (BadRequest, ValueError, TypeError) as err:
                return _error(400, str(err))
        if path == "/pause_generation":
            self.pause(str(body.get("mode", "abort")))
            return _ok({"success": True, "status": "ok", "message": "Generation paused."})
        if path == "/continue_generation":
            self.resume()
            return _ok({"success": True, "status": "ok", "message": "Generation continued."})
        if path in ("/flush_cache", "/abort_request"):
            return _ok({"success": True, "message": "ok", "num_aborted": 0})
        if path in ("/update_weights_from_disk", "/update_weights_from_tensor"):
            return _ok(await self.update(body))
        if path in (
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/destroy_weights_update_group",
        ):
            message = "a simulated engine joins no process group: --update-weight-transport disk"
            return _ok({"success": False, "message": message})
        return _error(404, f"no route {method} {path}")


def _ok(data: Any) -> tuple[int, bytes]:
    return 200, json.dumps(data).encode()


def _error(status: int, message: str) -> tuple[int, bytes]:
    return status, json.dumps({"error": {"message": message, "code": status}}).encode()


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


async def serve_connection(
    engine: SimEngine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """HTTP/1.1 with keep-alive: request line, headers, a Content-Length body; answers JSON."""
    try:
        while line := await reader.readline():
            if line in (b"\r\n", b"\n"):
                continue
            method, target, _ = line.decode("latin-1").split(" ", 2)
            length, close = 0, False
            while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip())
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
            raw = await reader.readexactly(length) if length else b""
            try:
                status, data = await engine.route(method, target, raw)
            except Exception as err:  # a bug here answers 500, as a server would
                status, data = _error(500, f"{type(err).__name__}: {err}")
            head = (
                f"HTTP/1.1 {status} {REASONS.get(status, 'X')}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                + ("Connection: close\r\n" if close else "")
                + "\r\n"
            )
            writer.write(head.encode() + data)
            await writer.drain()
            if close:
                break
    except (ConnectionError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        writer.close()


async def start_fleet(
    n: int,
    model: LatencyModel,
    *,
    vocab_size: int = 151_936,
    text_bytes_per_token: int = 4,
    host: str = "127.0.0.1",
    placement_host: str = "simulated-fleet",
) -> tuple[list[SimEngine], list[asyncio.Server]]:
    """N engines on free ports of `host`; each engine's `url` is set."""
    answers = Answers(vocab_size, text_bytes_per_token)
    engines, servers = [], []
    for i in range(n):
        engine = SimEngine(model, answers, placement_host, f"sim-{i}")
        server = await asyncio.start_server(
            functools.partial(serve_connection, engine), host, 0, backlog=1024
        )
        engine.url = f"http://{host}:{server.sockets[0].getsockname()[1]}"
        engines.append(engine)
        servers.append(server)
    return engines, servers


def model_from(args: argparse.Namespace) -> LatencyModel:
    return LatencyModel(
        overhead_s=args.overhead_ms / 1e3,
        prefill_s_per_token=args.prefill_us_per_token / 1e6,
        decode_step_s=args.decode_step_ms / 1e3,
        decode_per_seq_s=args.decode_per_seq_us / 1e6,
        transfer_bytes=int(args.transfer_gb * 1e9),
        bandwidth_bytes_s=args.bandwidth_gbs * 1e9,
    )


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overhead-ms", type=float, default=0.0, help="per request")
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0)
    parser.add_argument("--decode-step-ms", type=float, default=0.0, help="one decode step")
    parser.add_argument(
        "--decode-per-seq-us", type=float, default=0.0, help="added to a step per running sequence"
    )
    parser.add_argument(
        "--transfer-gb", type=float, default=0.0, help="the weights one update call moves"
    )
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0, help="GB/s of that move")


def model_argv(model: LatencyModel) -> list[str]:
    """The flags that give `model` to this script."""
    return [
        "--overhead-ms", str(model.overhead_s * 1e3),
        "--prefill-us-per-token", str(model.prefill_s_per_token * 1e6),
        "--decode-step-ms", str(model.decode_step_s * 1e3),
        "--decode-per-seq-us", str(model.decode_per_seq_s * 1e6),
        "--transfer-gb", str(model.transfer_bytes / 1e9),
        "--bandwidth-gbs", str(model.bandwidth_bytes_s / 1e9),
    ]  # fmt: skip


async def _main(args: argparse.Namespace) -> None:
    model = model_from(args)
    engines, servers = await start_fleet(
        args.engines, model, vocab_size=args.vocab_size,
        text_bytes_per_token=args.text_bytes_per_token, host=args.host,
        placement_host=args.placement_host,
    )  # fmt: skip
    urls = [e.url for e in engines]
    tmp = Path(args.urls_file).with_suffix(".tmp")
    tmp.write_text(json.dumps({"urls": urls, "pid": os.getpid(), "model": model.describe()}))
    tmp.rename(args.urls_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--urls-file", required=True, help="JSON {urls, pid} written when serving")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--vocab-size", type=int, default=151_936)
    parser.add_argument("--text-bytes-per-token", type=int, default=4)
    parser.add_argument(
        "--placement-host",
        default="simulated-fleet",
        help="the host each engine says it lives on (another machine than the trainer's)",
    )
    add_model_flags(parser)
    args = parser.parse_args(argv)
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
