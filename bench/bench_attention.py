"""Decode attention over a token pool: the engine's kernel choice, measured side by side.

    .venv/bin/python bench/bench_attention.py [--device cpu|cuda] [--rows 64] [--short 100]

One layer's decode attention (Qwen2.5-0.5B's heads: 14 query, 2 kv, dim 64) for `--rows`
requests whose keys sit on pages scattered over a pool (engine/kv/token_pool.py: a row's tokens run
in order within a page of 16), in two shapes: every row `--short` tokens long, and one row
of `--long` tokens beside the others. Each way reads the same keys and must give the same
output (checked against the first):

  grouped SDPA    what the engine runs (engine/executor/paged_attention.py): rows grouped by length
                  (at most 2 tokens read per live one), each group's keys gathered from the
                  pool and attended with PyTorch's SDPA, GQA packed;
  slot at a time  the same, with every key at a slot of its own scattered over the pool:
                  a pool that hands out one slot at a time from a churned free list (the
                  engine before pages), read one slot per gathered row;
  padded SDPA     the same gather, every row padded to the longest (one group);
  static cache    each row owns an equal share of a pool --pool-x times the live tokens
                  and attends to all of it, masked, read in place: what the static cache's
                  CUDA graphs did before issue 43 (other keys: no output check);
  FlexAttention   torch.nn.attention.flex_attention over the gathered keys with a length
                  mask (compiled where torch can compile it; eager, its reference path,
                  where it cannot: then its number says what it costs uncompiled).

Prints microseconds per call and the ratio to grouped SDPA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

HQ, HKV, D = 14, 2, 64


def timed(fn, device: str, repeats: int) -> float:  # type: ignore[no-untyped-def]
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def case(lengths: list[int], args: argparse.Namespace) -> list[tuple[str, float, float]]:
    import torch
    import torch.nn.functional as F

    from millstream.engine.executor.paged_attention import (
        StepPlan,
        decode_group,
        length_groups,
        paged_attention,
    )
    from millstream.engine.kv.token_pool import PAGE

    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    live = sum(lengths)
    capacity = live * args.pool_x
    capacity = -(-capacity // PAGE) * PAGE
    keys = torch.randn(PAGE + capacity, HKV, D, generator=gen).to(device, dtype)
    values = torch.randn(PAGE + capacity, HKV, D, generator=gen).to(device, dtype)
    n, width = len(lengths), max(lengths)
    pages = (torch.randperm(capacity // PAGE, generator=gen) + 1).tolist()
    table = torch.zeros(n, width, dtype=torch.long)
    for r, length in enumerate(lengths):  # each row on pages of its own, in order within
        row_pages = torch.tensor([pages.pop() for _ in range(-(-length // PAGE))])
        table[r, :length] = (row_pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:length]
    # The same keys at slots scattered one by one over another pool of the same size.
    live_slots = table[table > 0]
    scattered = torch.zeros_like(table)
    scattered[table > 0] = torch.randperm(capacity, generator=gen)[:live] + PAGE
    keys_s, values_s = torch.zeros_like(keys), torch.zeros_like(values)
    keys_s[scattered[table > 0].to(device)] = keys[live_slots.to(device)]
    values_s[scattered[table > 0].to(device)] = values[live_slots.to(device)]
    table, scattered = table.to(device), scattered.to(device)
    lengths_t = torch.tensor(lengths, device=device)
    q = torch.randn(1, HQ, n, D, generator=gen).to(device, dtype)
    k_new = torch.randn(1, HKV, n, D, generator=gen).to(device, dtype)

    class Layer:
        layer_idx = 0

    def plan(groups: list[list[int]], slots=table, pool=(keys, values)) -> StepPlan:  # type: ignore[no-untyped-def]
        built = []
        for members in groups:
            w = max(lengths[r] for r in members)
            index = torch.tensor(members, device=device)
            ragged = lengths_t[index] if min(lengths[r] for r in members) != w else None
            built.append(decode_group(index, slots[index, :w], ragged, w))
        out = StepPlan([pool[0]], [pool[1]], slots[torch.arange(n), lengths_t - 1], built)
        out.direct = len(built) == 1
        return out

    grouped, padded = plan(length_groups(lengths)), plan([list(range(n))])
    one_by_one = plan(length_groups(lengths), scattered, (keys_s, values_s))
    # A static cache: each row owns capacity / n columns of the pool, read in place.
    per_row = capacity // n
    static_k = keys[1 : 1 + n * per_row].view(n, per_row, HKV, D).transpose(1, 2)
    static_v = values[1 : 1 + n * per_row].view(n, per_row, HKV, D).transpose(1, 2)
    static_mask = (torch.arange(per_row, device=device) < lengths_t[:, None])[:, None, None, :]
    q_packed = q[0].transpose(0, 1).reshape(n, HKV, HQ // HKV, D)

    def static() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_packed, static_k, static_v, attn_mask=static_mask, scale=D**-0.5
        )

    def run(p: StepPlan):  # type: ignore[no-untyped-def]
        return lambda: paged_attention(Layer(), q, k_new, k_new, p, scaling=D**-0.5)[0]

    ways = [("grouped SDPA (the engine)", run(grouped)),
            ("grouped SDPA, a slot at a time", run(one_by_one)), ("padded SDPA", run(padded)),
            (f"static cache, pool {args.pool_x}x live (other keys)", static)]  # fmt: skip
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        k_g = keys.index_select(0, table.reshape(-1)).view(n, width, HKV, D).transpose(1, 2)
        v_g = values.index_select(0, table.reshape(-1)).view(n, width, HKV, D).transpose(1, 2)

        def live_only(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
            return kv_idx < lengths_t[b]

        block = create_block_mask(live_only, n, None, 1, width, device=device)
        flex = flex_attention
        if device == "cuda" or args.compile_flex:
            flex = torch.compile(flex_attention, dynamic=False)
        q_f = q[0].transpose(0, 1)[:, :, None, :]  # [n, Hq, 1, D]

        def flexed():  # type: ignore[no-untyped-def]
            k = keys.index_select(0, table.reshape(-1)).view(n, width, HKV, D).transpose(1, 2)
            v = values.index_select(0, table.reshape(-1)).view(n, width, HKV, D).transpose(1, 2)
            return flex(q_f, k, v, block_mask=block, enable_gqa=True)

        del k_g, v_g
        label = "FlexAttention" + (" (compiled)" if flex is not flex_attention else " (eager)")
        ways.append((label, flexed))
    except Exception as err:
        print(f"FlexAttention not run: {type(err).__name__}: {err}")

    reference = ways[0][1]().float().reshape(n, HQ * D)
    out = []
    base = None
    for name, fn in ways:
        got = fn().float().reshape(n, HQ * D)
        error = None if fn is static else (got - reference).abs().max().item()
        us = timed(fn, device, args.repeats)
        base = base or us
        out.append((name, us, us / base, error))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--short", type=int, default=100)
    parser.add_argument("--long", type=int, default=4096)
    parser.add_argument("--pool-x", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile-flex", action="store_true", help="compile it on the CPU too")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"one layer's decode attention, {HQ}/{HKV} heads of {D}, {args.device}, "
          f"{args.threads} thread(s), torch {torch.__version__}")  # fmt: skip
    shapes = {
        f"{args.rows} rows of {args.short}": [args.short] * args.rows,
        f"1 row of {args.long} + {args.rows - 1} of {args.short}":
            [args.long] + [args.short] * (args.rows - 1),
    }  # fmt: skip
    print("| shape | way | us per call | x grouped SDPA | max abs diff |")
    print("|---|---|---|---|---|")
    for shape, lengths in shapes.items():
        for name, us, ratio, error in case(lengths, args):
            diff = "-" if error is None else f"{error:.1e}"
            print(f"| {shape} | {name} | {us:,.0f} | {ratio:.2f}x | {diff} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
