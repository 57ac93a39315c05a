"""Engine throughput vs naive one-request-at-a-time HF generate(), and vs the engine of an
earlier commit or a real SGLang server, side by side in one run.

    .venv/bin/python bench/bench_engine.py [--baseline d9c9f3c] [--new-tokens 64]
    .venv/bin/python bench/bench_engine.py --peer sglang [--rounds 8] [--smoke]

`--peer sglang` is bench/engine_peer.py (its docstring has the design): millstream's engine
and SGLang 0.5.23 up side by side on one model, rows paired within rounds. What follows is the
default mode.

Builds a random Qwen2 model (hidden 256, 4 layers, 8k context, the tests' byte-level
tokenizer) in a temp dir, measures HF `model.generate()` one request at a time (greedy,
exactly --new-tokens tokens each), then starts `millstream engine` on the same directory and
sends the same kind of request over HTTP from 1, 16 and 64 concurrent clients (ignore_eos,
greedy). With --baseline REF, the engine of commit REF (a git worktree, same venv) runs
beside it: both stay up, and each of --rounds N rounds runs every row on one engine and then
the other (the order swapped every other round). Prints each row's best round (output
tokens/s, and its ratio to the naive baseline) and the median over rounds of the ratio of the
two engines in the same round: this machine's speed drifts by 10-20% from minute to minute,
and a ratio taken within one round, the median over rounds, is what that drift spares.

Long-context row: one 4096-token prompt beside 63 short ones, all at once (64 clients):
before the token pool (issue 43), a GPU engine's static cache gave each of 64 slots an
equal share and refused it; REF's static cache is tried too and its answer printed.

Burst table, a GRPO rollout's shape: 16 requests with n = 8 (temperature 1,
--burst-new-tokens each) sent at once over HTTP, against one batched HF `generate()` of the
same 128 rows in process. Both sides use --threads compute threads.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_load import client_warmup, engine_run, prompts  # noqa: E402


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


def baseline_tree(ref: str, tmp: Path) -> Path:
    """A git worktree of `ref` whose `millstream` package shadows this tree's (PYTHONPATH)."""
    import subprocess

    tree = tmp / f"baseline-{ref}"
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q", str(tree), ref],
        check=True,
    )
    (tree / "millstream").symlink_to(tree / "services")
    return tree


def remove_tree(tree: Path) -> None:
    import subprocess

    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)], check=False
    )


async def long_beside_short(url: str, long_tokens: int, short: int, new_tokens: int) -> tuple:
    """One long prompt and `short` short ones at once: (tokens, seconds, error or None)."""
    import httpx

    body = {"sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                "ignore_eos": True}}  # fmt: skip
    batch = prompts(1, long_tokens, seed=7) + prompts(short, 32, seed=8)
    limits = httpx.Limits(max_connections=short + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await client_warmup(http, url)
        start = time.perf_counter()
        responses = await asyncio.gather(
            *(http.post(f"{url}/generate", json={"input_ids": p, **body}) for p in batch)
        )
        seconds = time.perf_counter() - start
    if responses[0].status_code != 200:
        return 0, seconds, f"HTTP {responses[0].status_code}: {responses[0].text[:120]}"
    return sum(r.json()["meta_info"]["completion_tokens"] for r in responses), seconds, None


LONG = ", 4k + 63 short"


def engine_rows(engine, args, long: bool) -> dict[str, tuple]:
    """One round on `engine`: row name -> (concurrency, requests, tokens, seconds); the
    burst's row holds its median seconds for 128 rows. The long row only when `long`."""
    rows = {}
    for concurrency in args.concurrency:
        count = max(8, 2 * concurrency)
        batch = prompts(count, args.prompt_tokens, seed=concurrency)
        load = asyncio.run(engine_run(engine.url, batch, args.new_tokens, concurrency))
        rows[f"c{concurrency}"] = (concurrency, count, load.tokens, load.seconds)
    if long:
        n_tokens, seconds, error = asyncio.run(
            long_beside_short(engine.url, args.long_prompt, 63, args.long_new_tokens)
        )
        assert error is None, error
        rows[LONG] = (64, 64, n_tokens, seconds)
    burst_s = asyncio.run(
        engine_burst(engine.url, prompts(16, 8, seed=99), 8, args.burst_new_tokens)
    )
    rows["burst"] = (16, 16, 128, burst_s)
    return rows


def rate(row: tuple) -> float:
    """Tokens (the burst: rows) a second of a row (concurrency, requests, tokens, seconds)."""
    return row[2] / row[3]


def summary(rounds: list[dict[str, tuple]], base: list[dict[str, tuple]] | None) -> dict:
    """Per row: the best round (most tokens/s) and, beside a baseline, the median over
    rounds of this engine's rate over the baseline's in the same round (paired)."""
    out = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds if name in r]
        top = max(runs, key=rate)
        ratio = None
        if base is not None:
            pairs = [(r[name], b[name]) for r, b in zip(rounds, base, strict=True) if name in r]
            ratio = statistics.median(rate(a) / rate(b) for a, b in pairs)
        out[name] = (*top, ratio, len(runs))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--baseline", help="git ref of the engine to compare with (a worktree)")
    parser.add_argument(
        "--peer", choices=["sglang"], help="compare with a real SGLang server (engine_peer.py)"
    )
    parser.add_argument(
        "--sglang-python",
        help="--peer sglang: SGLang's venv Python (default $MILLSTREAM_SGLANG_PYTHON, else "
        "scripts/bootstrap_sglang.sh's)",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--naive-requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--long-prompt", type=int, default=4096)
    parser.add_argument("--long-new-tokens", type=int, default=32)
    parser.add_argument(
        "--burst-new-tokens", type=int, help="the burst's new tokens (default 6; --peer: 32)"
    )
    parser.add_argument(
        "--burst-prompts", type=int, default=64, help="--peer: GRPO groups in the burst (x 8)"
    )
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds of every row on each engine, in turn"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="--peer: one round of tiny rows (plumbing only)"
    )
    args = parser.parse_args(argv)
    if args.peer and args.baseline:
        parser.error("--peer and --baseline: one comparison a run")
    if args.burst_new_tokens is None:
        args.burst_new_tokens = 32 if args.peer else 6
    if args.smoke:
        from engine_peer import SMOKE

        vars(args).update(SMOKE)
    return args


def main() -> int:
    args = parse_args()
    if args.peer:
        from engine_peer import run

        return run(args)

    import torch

    torch.set_num_threads(args.threads)

    from tests.support.engine_proc import EngineProcess
    from tests.support.tiny_model import build_tiny_model

    flags = ["--max-running-requests", str(args.max_running_requests), "--num-threads",
             str(args.threads)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_model(
            tmp / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
            num_kv_heads=2, context_length=8192,
        )  # fmt: skip
        print(
            f"model: Qwen2 hidden {args.hidden}, {args.layers} layers; "
            f"{args.prompt_tokens} prompt + {args.new_tokens} output tokens per request"
        )
        naive = prompts(args.naive_requests, args.prompt_tokens, seed=1)
        n_tokens, seconds = naive_generate(model_dir, naive, args.new_tokens)
        naive_rate = n_tokens / seconds
        hf_burst_s = hf_burst(model_dir, prompts(16, 8, seed=99), 8, args.burst_new_tokens)
        engines: list[tuple[str, dict[str, str]]] = []
        tree = None
        if args.baseline:
            tree = baseline_tree(args.baseline, tmp)
            engines.append((f"engine at {args.baseline}", {"PYTHONPATH": str(tree)}))
        engines.append(("engine, this tree", {}))
        rounds: dict[str, list[dict[str, tuple]]] = {label: [] for label, _ in engines}
        static_answer = None
        try:
            # Both engines stay up side by side (an idle one waits on its queue); each round
            # runs every row on one then the other, in the other order every other round,
            # so that a slow minute of this machine hits both alike and neither always runs
            # second. The long row runs in the first round only (minutes on an old engine).
            running = {}
            try:
                for label, env in engines:
                    running[label] = EngineProcess(model_dir, tmp, *flags, env=env)
                for r in range(args.rounds):
                    for label, _ in engines if r % 2 == 0 else engines[::-1]:
                        rounds[label].append(engine_rows(running[label], args, long=r == 0))
                    if args.baseline:  # progress: this round's ratios
                        mine, theirs = rounds[engines[-1][0]][-1], rounds[engines[0][0]][-1]
                        ratios = "  ".join(
                            f"{name.strip(', ')} {rate(mine[name]) / rate(theirs[name]):.2f}x"
                            for name in mine
                        )
                        print(f"round {r + 1}/{args.rounds}: {ratios}", file=sys.stderr)
            finally:
                for engine in running.values():
                    engine.stop()
            if tree is not None:  # the GPU's default cache then, on this CPU
                static = [*flags[:1], "64", *flags[2:], "--kv-cache", "static",
                          "--max-total-tokens", str(64 * 1024)]  # fmt: skip
                try:
                    engine = EngineProcess(model_dir, tmp, *static, env={"PYTHONPATH": str(tree)})
                except RuntimeError as err:  # a REF after the static cache was gone
                    if "unrecognized arguments: --kv-cache" not in str(err):
                        raise
                    static_answer = "not tried: it has no static cache"
                else:
                    try:
                        static_answer = asyncio.run(
                            long_beside_short(
                                engine.url, args.long_prompt, 63, args.long_new_tokens
                            )
                        )[2]
                    finally:
                        engine.stop()
        finally:
            if tree is not None:
                remove_tree(tree)

    base = rounds[engines[0][0]] if args.baseline else None
    table = {label: summary(runs, base) for label, runs in rounds.items()}
    versus = f"x {args.baseline} (median)" if args.baseline else ""
    header = (f"{'system':<34} {'conc':>5} {'reqs':>5} {'tokens':>7} {'secs':>7} {'tok/s':>8} "
              f"{'x HF':>6} {versus:>20}")  # fmt: skip
    print(
        f"best of {args.rounds} round(s) per row; beside --baseline, the median over rounds "
        "of the two engines' ratio in the same round"
    )
    print(header)
    print("-" * len(header))
    print(f"{'HF generate(), one at a time':<34} {1:>5} {len(naive):>5} {n_tokens:>7} "
          f"{seconds:>7.2f} {naive_rate:>8.1f} {1:>5.2f}x")  # fmt: skip
    for label, rows in table.items():
        for name, (conc, reqs, tokens, secs, ratio, runs) in rows.items():
            if name == "burst":
                continue
            per_s = tokens / secs
            paired = "" if ratio is None else f"{ratio:.2f}x ({runs} rounds)"
            suffix = LONG if name == LONG else ""
            print(f"{label + suffix:<34} {conc:>5} {reqs:>5} {tokens:>7} "
                  f"{secs:>7.2f} {per_s:>8.1f} {per_s / naive_rate:>5.2f}x {paired:>20}")  # fmt: skip
    if static_answer is not None:
        print(f"engine at {args.baseline} with --kv-cache static (64 x 1024): {static_answer}")
    print(f"\nburst: 16 requests x n=8 = 128 rows, {args.burst_new_tokens} new tokens")
    print(f"{'system':<44} {'median s':>9} {'rows/s':>8} {'x HF':>6} {versus:>20}")
    print(f"{'HF generate(), 128 rows in one batch':<44} {hf_burst_s:>9.4f} "
          f"{128 / hf_burst_s:>8.0f} {1:>5.2f}x")  # fmt: skip
    for label, rows in table.items():
        _, _, _, burst_s, ratio, runs = rows["burst"]
        paired = "" if ratio is None else f"{ratio:.2f}x ({runs} rounds)"
        print(f"{label + ', 16 x n=8':<44} {burst_s:>9.4f} {128 / burst_s:>8.0f} "
              f"{hf_burst_s / burst_s:>5.2f}x {paired:>20}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
