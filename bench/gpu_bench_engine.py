"""bench/bench_gpu.py's engine and sync sections (its module docstring says what each
measures): HF generate, the engine over HTTP at each concurrency and its variants (CUDA graphs
off, FP8), the decode step over a small and a large pool, and the colocated weight update.
Every row goes to `add` as soon as it is measured (gpu_bench_util.Results writes it)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_bench_util import (
    ARITH,
    Row,
    best_of,
    free_memory,
    num,
    progress,
    prompts,
    size,
    sync_device,
)

DECODE_ROWS = (64, 100)  # the decode-step rows: 64 rows of 100 tokens (8 with --small)
POOL_PER_ROW = (1024, 32768)  # tokens a row of the pool, small then large
Add = Callable[..., None]


def hf_generate(model: Any, args: argparse.Namespace) -> tuple[int, float]:
    """(tokens made, seconds) of one batched greedy generate of exactly --new-tokens each."""
    import torch

    ids_BT = torch.tensor(prompts(args.hf_batch, args.prompt_tokens, 7), device=model.device)

    def generate(ids_BT: Any, new: int) -> Any:
        return model.generate(ids_BT, attention_mask=torch.ones_like(ids_BT), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new)  # fmt: skip

    with torch.inference_mode():
        generate(ids_BT, 4)  # warm-up
        sync_device(args.device)
        start = time.perf_counter()
        out = generate(ids_BT, args.new_tokens)
        sync_device(args.device)
    return (out.shape[1] - ids_BT.shape[1]) * out.shape[0], time.perf_counter() - start


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine's flags: bf16, room for the highest concurrency; on a GPU its memory
    fraction and CUDA graphs (or not)."""
    flags = ["--dtype", "bfloat16", "--num-threads", str(args.threads),
             "--max-running-requests", str(max(args.concurrency)), "--device", args.device]  # fmt: skip
    if args.device == "cuda":
        flags += ["--mem-fraction-static", str(args.mem_fraction_static)]
        if args.disable_cuda_graph:
            return [*flags, "--disable-cuda-graph"]
        return [*flags, "--cuda-graph-max-bs", str(args.cuda_graph_max_bs or max(args.concurrency))]
    return flags


def decode_step_rows(model_dir: Path, args: argparse.Namespace, add: Add) -> None:
    """The decode step of DECODE_ROWS over pools of POOL_PER_ROW tokens a row (bench_gpu.py's
    docstring), in process, with the weights-read limit in the note."""
    import torch

    from millstream.engine.executor.model_runner import ModelRunner
    from millstream.engine.kv.sizing import kv_bytes_per_token

    cuda = args.device == "cuda"
    n, length = (8 if args.small else DECODE_ROWS[0]), DECODE_ROWS[1]
    runner = ModelRunner(str(model_dir), "bfloat16" if cuda else "float32", args.device)
    per_token = kv_bytes_per_token(runner.model.config, runner.dtype)
    gb = 2**30 if cuda else 2**26
    bandwidth = 2 * gb / (raw_copy_ms(gb, args.device, 5) / 1e3)  # a copy reads and writes
    limit_ms = runner.weight_bytes / bandwidth * 1e3
    steps: dict[int, float] = {}
    for per_row in POOL_PER_ROW:
        free_memory(args.device)
        tokens = n * per_row
        if cuda:
            tokens = min(tokens, int(torch.cuda.mem_get_info()[0] * 0.5) // per_token)
        progress(f"engine: decode step, {n} rows x {length} tokens, pool of {tokens} tokens ...")
        steps[per_row] = _decode_ms(runner, tokens, n, length, args)
        ratio = steps[per_row] / steps[POOL_PER_ROW[0]]
        add(Row("engine", f"decode step, {n} rows of {length} tokens, pool of "
                        f"{tokens:,} tokens ({tokens // n:,} a row)", steps[per_row], "ms",
                        ratio, f"pool of {POOL_PER_ROW[0]} a row",
                        note=f"weights-read limit {limit_ms:.3g} ms ({runner.weight_bytes / 2**20:.3g}"
                             f" MiB at {bandwidth / 1e9:.0f} GB/s)",
                        extra={"decode_pool": per_row, "limit_ms": limit_ms}))  # fmt: skip
    del runner
    free_memory(args.device)


def _decode_ms(runner: Any, tokens: int, n: int, length: int, args: argparse.Namespace) -> float:
    """The fastest decode step (ms) of n rows of `length` tokens over a pool of `tokens`."""
    import random

    from millstream.engine.kv.token_pool import TokenPool
    from millstream.engine.paged_batch import PagedBatch
    from millstream.engine.sampling import SamplingParams
    from millstream.engine.sequence import Sequence

    pool = TokenPool(runner.model.config, tokens, runner.dtype, runner.device)
    batch = PagedBatch(runner.model, pool, max_rows=n, context_length=4 * length,
                       cuda_graph_max_bs=n if args.device == "cuda" else None)  # fmt: skip
    if batch.graphs is not None:
        batch.graphs.capture_all()
    seqs = [Sequence(str(i), prompts(1, length, i)[0], SamplingParams(max_new_tokens=10**6),
                     random.Random(i)) for i in range(n)]  # fmt: skip
    handles, _ = batch.prefill([s.prompt_ids for s in seqs], [1] * n)
    for seq, handle in zip(seqs, handles, strict=True):
        seq.output_ids.append(65)
        batch.add(seq, handle)
    batch.drop(handles)

    def step() -> None:
        batch.decode(runner.model)
        for seq in seqs:
            seq.output_ids.append(65)

    return best_of(step, 20, args.device) * 1e3


def engine_section(url: str, hf: Row, args: argparse.Namespace, flags: list[str], add: Add) -> None:
    from engine_load import engine_run

    base = hf.value or 1.0
    for conc in args.concurrency:
        count = conc * args.rounds
        progress(f"engine: concurrency {conc}, {count} requests x {args.new_tokens} tokens ...")
        asyncio.run(engine_run(url, prompts(conc, args.prompt_tokens, 99), 8, conc))  # warm-up
        load = asyncio.run(
            engine_run(url, prompts(count, args.prompt_tokens, conc), args.new_tokens, conc)
        )
        made, seconds = load.tokens, load.seconds
        if made != count * args.new_tokens:
            raise RuntimeError(f"engine made {made} tokens, not {count} x {args.new_tokens}")
        add(Row("engine", f"millstream engine (HTTP), concurrency {conc}", made / seconds,
                "tokens/s", made / seconds / base, "HF generate",
                f"{count} requests in {seconds:.2f} s",
                extra={"tokens": made, "seconds": seconds, "concurrency": conc,
                       "engine_flags": flags}))  # fmt: skip


# -- sync -----------------------------------------------------------------------------------


def raw_copy_ms(nbytes: int, device: str, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        sync_device(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def measure_syncs(model: Any, router_url: str, args: argparse.Namespace) -> tuple[dict, str, int]:
    """Median phases (seconds) of --syncs pause-to-continue syncs after the first, the route,
    the bytes."""
    from millstream.trainer.weights.sync import WeightSync

    async def go() -> tuple[list[dict[str, float]], str, int]:
        ws = WeightSync(router_url, pause_mode="in_place", timeout_s=120.0, transport="auto",
                        bucket_bytes=args.bucket_mb * 2**20)  # fmt: skip
        runs, nbytes = [], 0
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its start-up line
                route = str(next(iter((await ws.routes(model.device)).values())))
            for version in range(1, args.syncs + 2):
                report = await ws.sync(model.named_parameters(), version)
                if report.removed:
                    raise RuntimeError(f"weight sync v{version} removed {report.removed}")
                nbytes = report.bytes
                if version > 1:
                    runs.append(report.seconds)
        finally:
            await ws.close()
        return runs, route, nbytes

    runs, route, nbytes = asyncio.run(go())
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}, route, nbytes


def sync_section(model: Any, router_url: str, args: argparse.Namespace, add: Add) -> None:
    progress(f"sync: {args.syncs + 1} WeightSync.sync pause-to-continue ...")
    phases, route, nbytes = measure_syncs(model, router_url, args)
    gb = nbytes / 1e9
    progress(f"sync: raw copy_ of {size(nbytes)} on {args.device} ...")
    raw = raw_copy_ms(nbytes, args.device, args.syncs)
    total = phases["total"] * 1e3
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items() if k != "total")
    add(
        Row("sync", f"raw copy_ on the device, {size(nbytes)}", raw, "ms", 1.0, "raw copy",
            f"{num(raw / gb)} ms/GB", extra={"bytes": nbytes, "ms_per_gb": raw / gb}),
        Row("sync", f"WeightSync.sync pause->continue, {route}", total, "ms", total / raw,
            "raw copy", f"{num(total / gb)} ms/GB; {parts} ms",
            extra={"bytes": nbytes, "ms_per_gb": total / gb, "route": route,
                   "phases_ms": {k: v * 1e3 for k, v in phases.items()}}),
    )  # fmt: skip


def engine_and_sync(model_dir: Path, args: argparse.Namespace, tmp: Path, rows: list[Row],
                    add: Add) -> None:  # fmt: skip
    """HF generate, then one engine for the engine rows and the syncs (through a router),
    then the variants and the decode step; `rows` is every row so far (the variants' ratios)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.router_proc import ServiceProcess

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    hf = None
    if "engine" in args.only:
        progress(f"engine: HF generate, {args.hf_batch} x {args.new_tokens} tokens ...")
        made, seconds = hf_generate(model, args)
        hf = Row("engine", f"HF generate bf16, {args.hf_batch} prompts x {args.new_tokens} "
                 "tokens in one batch", made / seconds, "tokens/s", 1.0, "HF generate",
                 extra={"tokens": made, "seconds": seconds})  # fmt: skip
        add(hf)
    free_memory(args.device)
    progress("starting millstream engine ...")
    flags = engine_flags(args)
    engine = ServiceProcess("engine", ["--model-path", str(model_dir), *flags], tmp)
    router = None
    try:
        engine.wait_ready("/health", timeout_s=600)
        if hf is not None:
            engine_section(engine.url, hf, args, flags, add)
        if "sync" in args.only:
            router = ServiceProcess("router", ["--worker-urls", engine.url], tmp)
            router.wait_ready("/health")
            sync_section(model, router.url, args, add)
    finally:
        for proc in (router, engine):
            if proc is not None:
                proc.stop()
    if hf is not None and args.device == "cuda" and not args.disable_cuda_graph:
        add(variant_engine_row(model_dir, rows, args, tmp, graphs=False))
    if hf is not None and not args.no_fp8:
        add(variant_engine_row(model_dir, rows, args, tmp, graphs=None))
    if hf is not None:
        decode_step_rows(model_dir, args, add)


def variant_engine_row(
    model_dir: Path, rows: list[Row], args: argparse.Namespace, tmp: Path, graphs: bool | None
) -> Row:
    """The engine once more at the highest concurrency, as a variant of the rows measured:
    `graphs` False, the bf16 engine with --disable-cuda-graph (eager decoding over the live
    columns); None, the FP8 engine on an FP8 copy of the model (examples/arith/make_fp8.py:
    e4m3 weights with 128 x 128 block scales, engine/quant/fp8.py). Ratio to HF generate; to the
    bf16 engine with graphs in the note."""
    from engine_load import engine_run

    from tests.support.router_proc import ServiceProcess

    conc = max(args.concurrency)
    hf = next(r.value for r in rows if r.name.startswith("HF generate")) or 1.0
    bf16 = next((r.value for r in rows if r.extra.get("concurrency") == conc), None)
    flags = engine_flags(args)
    if graphs is False:
        path, label = model_dir, f"millstream engine, CUDA graphs off, concurrency {conc}"
        flags = engine_flags(argparse.Namespace(**{**vars(args), "disable_cuda_graph": True}))
        extra: dict[str, Any] = {"graphs": False}
    else:
        progress("engine: making an FP8 copy of the model ...")
        path = make_fp8_copy(model_dir, tmp)
        label = f"millstream engine FP8 (e4m3, 128x128 blocks), concurrency {conc}"
        extra = {"fp8": True}
    progress(f"engine: {label} ...")
    free_memory(args.device)
    engine = ServiceProcess("engine", ["--model-path", str(path), *flags], tmp)
    try:
        engine.wait_ready("/health", timeout_s=600)
        asyncio.run(engine_run(engine.url, prompts(conc, args.prompt_tokens, 99), 8, conc))
        count = conc * args.rounds
        load = asyncio.run(
            engine_run(engine.url, prompts(count, args.prompt_tokens, conc), args.new_tokens, conc)
        )
        made, seconds = load.tokens, load.seconds
    finally:
        engine.stop()
    tps = made / seconds
    note = f"{tps / bf16:.2f}x the bf16 engine" + (" with graphs" if graphs is False else "")
    return Row("engine", label, tps, "tokens/s", tps / hf, "HF generate",
               note=note if bf16 else "",
               extra={"tokens": made, "seconds": seconds, "concurrency": conc,
                      "engine_flags": flags, "vs_bf16": tps / bf16 if bf16 else None,
                      **extra})  # fmt: skip


def make_fp8_copy(model_dir: Path, tmp: Path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fp8", ARITH / "make_fp8.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_fp8(model_dir, tmp / "model-fp8")
