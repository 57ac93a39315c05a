"""One GPU, four questions, one table: millstream's train step, engine, colocated weight update and
`make run`'s arith job, each beside a plain baseline measured in the same run.

    .venv/bin/python bench/bench_gpu.py [--device cuda] [--only train,engine,sync,run]
        [--json runs/bench_gpu.json]
    .venv/bin/python bench/bench_gpu.py --device cpu --small --only train,engine,sync   (smoke)

The model is Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864, vocabulary 151936, tied embeddings) with random weights from a seed, saved with
save_pretrained in a temp dir beside the arith example's tokenizer (examples/arith/model: 259
byte-level tokens; the ids past it decode to nothing, and every request here is token ids).
--small: hidden 64, 2 layers, vocabulary 512, and every size below scaled down.

train   one GRPO step (forward, backward, AdamW) on --batch rows of --seq-len tokens (a
        quarter prompt, the rest response; every row its own prompt, so the shared-prompt
        layout does not apply; groups of 8 for the advantages), in micro-batches of
        --micro-batch-size rows:
          plain bf16 loop   written below: bf16 parameters and gradients, fp32 masters stepped
                            by fused AdamW (the gradients cast to fp32 once per step, clipped
                            at 1.0), logits upcast to fp32 for the log-softmax and the gather
                            of the sampled tokens, loss -sum(exp(logp - logp.detach()) * adv)
                            over the tokens (PPO's ratio at its one step);
          millstream fp32   TorchBackend.train_rollout (bench_train_step.py's way);
          millstream bf16   the same with --bf16 (precision.py: bf16 weights, fp32 masters).
        The backend computes the entropy too (a metric): that is part of what it costs.
        Tokens/s of the best of --repeats steps after a warm-up one; ratio to the plain loop.
engine  `millstream engine` on the model (bf16; on a GPU its CUDA graphs) at each
        --concurrency, --rounds requests per client of --new-tokens tokens each (ignore_eos,
        greedy: every request makes exactly that many), against HF `generate` in bf16 of
        --hf-batch prompts x --new-tokens in one batch. Output tokens/s; ratio to HF. At the
        highest concurrency twice more: on a GPU with --disable-cuda-graph (eager decoding),
        and on an FP8 copy of the model (not with --no-fp8).
sync    WeightSync.sync (trainer/weights/sync.py, transport auto: CUDA IPC on a GPU, a /dev/shm
        file on the CPU) of the whole model, in the engine's dtype, from this process to that
        engine through a `millstream router`: pause to continue, the median of --syncs after
        the first; beside it a raw copy_ of the same number of bytes on the device
        (synchronized). ms, ms per GB (1e9 bytes); ratio to the raw copy (lower is better).
run     examples/arith/run.sh (`make run`) in sync (MODE=train) and async mode with
        --colocate on --device, and as `make run` runs it on the CPU (no GPU visible):
        seconds from the trainer's start to the first greedy eval >= 85% and completions/s
        (the trainer's summary.json), the weight transport its start-up line chose, and the
        engine's CUDA graph captures. "not run: <why>" where --colocate is refused;
        --no-cpu-run leaves out the CPU runs (make gpu-check: the GPU's rows only).

Decode step (engine section, in process): 64 rows of 100 tokens decoded over a token pool
sized for 1k tokens a row, then for 32k (as much of it as fits in half the free memory), ms
a step with CUDA graphs on a GPU, beside the weights-read limit (the weights' bytes over the
memory bandwidth a 1 GB device copy reaches): the step must not grow with the pool.

Goals beside the rows: train with --bf16 >= 0.85x the plain bf16 loop; engine >= 5x HF
generate at the highest concurrency (64); the decode step over the 32k pool <= 1.5x the 1k
one; the FP8 engine >= 1.0x the bf16 engine; the colocated weight update <= 20 ms per GB.
Progress goes to stderr, one line per measurement; the table to stdout; --json PATH gets the
resources, settings, rows and goals.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

SECTIONS = ("train", "engine", "sync", "run")
ARITH = REPO_ROOT / "examples" / "arith"
QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                 max_position_embeddings=32768, rope_theta=1e6)  # fmt: skip
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=1024)  # fmt: skip
# Sizes: (full, --small); a flag given on the command line wins.
SIZES = {
    "batch": (64, 4), "seq_len": (512, 32), "micro_batch_size": (8, 4), "repeats": (3, 1),
    "new_tokens": (256, 16), "prompt_tokens": (128, 16), "concurrency": ("1,16,64", "1,4"),
    "hf_batch": (64, 4), "rounds": (2, 1), "syncs": (10, 4),
}  # fmt: skip
GOALS = {"train": 0.85, "engine": 5.0, "sync_ms_per_gb": 20.0, "decode_pool": 1.5, "fp8": 1.0}
DECODE_ROWS = (64, 100)  # the decode-step rows: 64 rows of 100 tokens (8 with --small)
POOL_PER_ROW = (1024, 32768)  # tokens a row of the pool, small then large
GROUP = 8  # samples per prompt, for the advantages


@dataclass
class Row:
    section: str
    name: str
    value: float | None  # None: not run (note says why)
    unit: str
    ratio: float | None = None
    base: str = ""  # what the ratio is to
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def progress(message: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync_device(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None


# -- the model ------------------------------------------------------------------------------


def build_model_dir(path: Path, small: bool, device: str) -> tuple[Path, int]:
    """A Qwen2 of the chosen shape, random from seed 0, with the arith example's tokenizer;
    its parameter count."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    for f in (ARITH / "model").iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, path / f.name)
    tok = AutoTokenizer.from_pretrained(path)
    config = Qwen2Config(**(TINY if small else QWEN2_05B), tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, torch_dtype="float32")  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # the 0.5B's init is minutes on a CPU, a second on a GPU
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path, sum(p.numel() for p in model.parameters())


# -- train ----------------------------------------------------------------------------------


def make_samples(n: int, seq_len: int, vocab: int) -> list:
    """n rows of seq_len tokens, each its own prompt (a quarter), rewards +-1 within each group."""
    import random

    from millstream.trainer.backends.base import TrainSample

    rng = random.Random(0)
    prompt = seq_len // 4
    samples = []
    for i in range(n):
        response = seq_len - prompt
        samples.append(TrainSample(
            tokens=[rng.randrange(vocab) for _ in range(seq_len)], prompt_len=prompt,
            loss_mask=[1] * response, rollout_logprobs=[-4.0] * response,
            reward=1.0 if (i + i // GROUP) % 2 else -1.0,
        ))  # fmt: skip
    return samples


def millstream_flags(args: argparse.Namespace, bf16: bool) -> list[str]:
    group = min(GROUP, args.batch)
    flags = ["--rollout-batch-size", str(args.batch // group), "--n-samples-per-prompt",
             str(group), "--micro-batch-size", str(args.micro_batch_size), "--lr", "1e-6"]  # fmt: skip
    if args.log_probs_chunk_size:
        flags += ["--log-probs-chunk-size", str(args.log_probs_chunk_size)]
    return flags + (["--bf16"] if bf16 else [])


def best_of(step, repeats: int, device: str) -> float:  # type: ignore[no-untyped-def]
    """The fastest of `repeats` calls of `step`, after a warm-up one."""
    step()
    times = []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        step()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return min(times)


def time_millstream(model_dir: Path, samples: list, args, bf16: bool) -> tuple[float, Any]:
    from millstream.common.config import parse_run_config
    from millstream.trainer.backends.torch_backend import TorchBackend

    cfg = parse_run_config(millstream_flags(args, bf16))
    backend = TorchBackend(cfg, model_dir, ref_dir=None, total_steps=args.repeats + 2)
    return best_of(lambda: backend.train_rollout(samples, 1), args.repeats, args.device), cfg


class PlainBf16Loop:
    """The baseline step (module docstring): bf16 model, fp32 AdamW masters."""

    def __init__(self, model_dir: Path, samples: list, cfg: Any, args: argparse.Namespace):
        import torch
        from transformers import AutoModelForCausalLM

        dev = torch.device(args.device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(dev)
        self.model.config.use_cache = False
        self.model.train()
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
            weight_decay=o.weight_decay, fused=True,
        )  # fmt: skip
        prompt = samples[0].prompt_len
        ids_BS = torch.tensor([s.tokens for s in samples])
        reward_B = torch.tensor([s.reward for s in samples]).view(-1, min(GROUP, len(samples)))
        adv_B = ((reward_B - reward_B.mean(1, keepdim=True))
                 / (reward_B.std(1, keepdim=True) + 1e-6)).reshape(-1)  # fmt: skip
        mb = args.micro_batch_size
        self.micro_batches = [
            (ids_BS[i : i + mb].to(dev), adv_B[i : i + mb].to(dev))
            for i in range(0, len(ids_BS), mb)
        ]
        self.prompt = prompt
        self.n_tokens = ids_BS.shape[0] * (ids_BS.shape[1] - prompt)
        self.clip = o.clip_grad

    def step(self) -> None:
        import torch

        for ids_BS, adv_B in self.micro_batches:
            logits_BTV = self.model(input_ids=ids_BS).logits[:, self.prompt - 1 : -1]
            logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
            logp_BT = logp_BTV.gather(-1, ids_BS[:, self.prompt :, None]).squeeze(-1)
            ratio_BT = torch.exp(logp_BT - logp_BT.detach())
            loss = -(ratio_BT * adv_B[:, None]).sum() / self.n_tokens
            loss.backward()
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)


def train_section(model_dir: Path, args: argparse.Namespace, vocab: int) -> list[Row]:
    samples = make_samples(args.batch, args.seq_len, vocab)
    tokens = args.batch * args.seq_len
    shape = f"{args.batch} x {args.seq_len} tokens, micro-batch {args.micro_batch_size}"
    measured = []
    for name, bf16 in (("millstream torch, fp32", False), ("millstream torch, --bf16", True)):
        progress(f"train: {name}, {shape} ...")
        free_memory(args.device)
        seconds, cfg = time_millstream(model_dir, samples, args, bf16)
        measured.append((name, seconds, peak_gb(args.device)))
    progress(f"train: plain bf16 loop, {shape} ...")
    free_memory(args.device)
    loop = PlainBf16Loop(model_dir, samples, cfg, args)
    plain = best_of(loop.step, args.repeats, args.device)
    plain_peak = peak_gb(args.device)
    del loop
    free_memory(args.device)
    rows = [Row("train", f"plain bf16 loop (bf16 params, fp32 AdamW masters), {shape}",
                tokens / plain, "tokens/s", 1.0, "plain loop",
                extra={"seconds": plain, "peak_gb": plain_peak})]  # fmt: skip
    for name, seconds, peak in measured:
        rows.append(Row("train", name, tokens / seconds, "tokens/s", plain / seconds,
                        "plain loop", extra={"seconds": seconds, "peak_gb": peak}))  # fmt: skip
    for row in rows:
        if row.extra["peak_gb"] is not None:
            row.detail = f"peak {row.extra['peak_gb']:.1f} GB"
    return rows


# -- engine ---------------------------------------------------------------------------------


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(count)]


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


def decode_step_rows(model_dir: Path, args: argparse.Namespace) -> list[Row]:
    """The decode step of DECODE_ROWS over pools of POOL_PER_ROW tokens a row (module
    docstring), in process, with the weights-read limit in the note."""
    import torch

    from millstream.engine.model_runner import ModelRunner, kv_bytes_per_token

    cuda = args.device == "cuda"
    n, length = (8 if args.small else DECODE_ROWS[0]), DECODE_ROWS[1]
    runner = ModelRunner(str(model_dir), "bfloat16" if cuda else "float32", args.device)
    per_token = kv_bytes_per_token(runner.model.config, runner.dtype)
    gb = 2**30 if cuda else 2**26
    bandwidth = 2 * gb / (raw_copy_ms(gb, args.device, 5) / 1e3)  # a copy reads and writes
    limit_ms = runner.weight_bytes / bandwidth * 1e3
    steps: dict[int, float] = {}
    rows = []
    for per_row in POOL_PER_ROW:
        free_memory(args.device)
        tokens = n * per_row
        if cuda:
            tokens = min(tokens, int(torch.cuda.mem_get_info()[0] * 0.5) // per_token)
        progress(f"engine: decode step, {n} rows x {length} tokens, pool of {tokens} tokens ...")
        steps[per_row] = _decode_ms(runner, tokens, n, length, args)
        ratio = steps[per_row] / steps[POOL_PER_ROW[0]]
        rows.append(Row("engine", f"decode step, {n} rows of {length} tokens, pool of "
                        f"{tokens:,} tokens ({tokens // n:,} a row)", steps[per_row], "ms",
                        ratio, f"pool of {POOL_PER_ROW[0]} a row",
                        note=f"weights-read limit {limit_ms:.3g} ms ({runner.weight_bytes / 2**20:.3g}"
                             f" MiB at {bandwidth / 1e9:.0f} GB/s)",
                        extra={"decode_pool": per_row, "limit_ms": limit_ms}))  # fmt: skip
    del runner
    free_memory(args.device)
    return rows


def _decode_ms(runner: Any, tokens: int, n: int, length: int, args: argparse.Namespace) -> float:
    """The fastest decode step (ms) of n rows of `length` tokens over a pool of `tokens`."""
    import random

    from millstream.engine.paged_batch import PagedBatch
    from millstream.engine.sampling import SamplingParams
    from millstream.engine.sequence import Sequence
    from millstream.engine.token_pool import TokenPool

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


def engine_section(url: str, hf: Row, args: argparse.Namespace) -> list[Row]:
    from bench_engine import engine_run

    rows = [hf]
    base = hf.value or 1.0
    for conc in args.concurrency:
        count = conc * args.rounds
        progress(f"engine: concurrency {conc}, {count} requests x {args.new_tokens} tokens ...")
        asyncio.run(engine_run(url, prompts(conc, args.prompt_tokens, 99), 8, conc))  # warm-up
        made, seconds = asyncio.run(
            engine_run(url, prompts(count, args.prompt_tokens, conc), args.new_tokens, conc)
        )
        if made != count * args.new_tokens:
            raise RuntimeError(f"engine made {made} tokens, not {count} x {args.new_tokens}")
        rows.append(Row("engine", f"millstream engine (HTTP), concurrency {conc}",
                        made / seconds, "tokens/s", made / seconds / base, "HF generate",
                        f"{count} requests in {seconds:.2f} s",
                        extra={"tokens": made, "seconds": seconds, "concurrency": conc}))  # fmt: skip
    return rows


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


def sync_section(model: Any, router_url: str, args: argparse.Namespace) -> list[Row]:
    progress(f"sync: {args.syncs + 1} WeightSync.sync pause-to-continue ...")
    phases, route, nbytes = measure_syncs(model, router_url, args)
    gb = nbytes / 1e9
    progress(f"sync: raw copy_ of {size(nbytes)} on {args.device} ...")
    raw = raw_copy_ms(nbytes, args.device, args.syncs)
    total = phases["total"] * 1e3
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items() if k != "total")
    return [
        Row("sync", f"raw copy_ on the device, {size(nbytes)}", raw, "ms", 1.0, "raw copy",
            f"{num(raw / gb)} ms/GB", extra={"bytes": nbytes, "ms_per_gb": raw / gb}),
        Row("sync", f"WeightSync.sync pause->continue, {route}", total, "ms", total / raw,
            "raw copy", f"{num(total / gb)} ms/GB; {parts} ms",
            extra={"bytes": nbytes, "ms_per_gb": total / gb, "route": route,
                   "phases_ms": {k: v * 1e3 for k, v in phases.items()}}),
    ]  # fmt: skip


# -- run ------------------------------------------------------------------------------------


class Refused(Exception):
    """`millstream train` refused a flag (its parser's error line)."""


def arith_run(mode: str, on_device: bool, args: argparse.Namespace, tmp: Path) -> dict:
    """One run.sh; its summary: seconds to the first eval >= 85%, completions/s, wall."""
    run_dir = tmp / f"arith-{mode}-{'dev' if on_device else 'cpu'}"
    env = {**os.environ, "MODE": mode, "RUN_DIR": str(run_dir),
           "NUM_ROLLOUT": str(args.arith_rollouts)}  # fmt: skip
    extra = ["--colocate"] if on_device else []
    if not on_device:
        env["CUDA_VISIBLE_DEVICES"] = ""
    log = tmp / f"{run_dir.name}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(ARITH / "run.sh"), *extra], cwd=REPO_ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(args.run_timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # run.sh hands SIGTERM to the trainer, which stops its services
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: what it started
                proc.wait()
            raise RuntimeError(f"run.sh did not finish in {args.run_timeout:g} s") from None
    wall = time.perf_counter() - start
    if code != 0:
        lines = log.read_text(errors="replace").strip().splitlines()
        refused = [
            line for line in lines if line.startswith("millstream train") and "error:" in line
        ]
        if code == 2 and refused:  # argparse's exit: a flag not accepted (yet)
            raise Refused(refused[-1])
        raise RuntimeError(f"run.sh exited {code}: {' | '.join(lines[-3:])}")
    summary = json.loads((run_dir / "summary.json").read_text())
    first = [s for _, s, acc in summary["eval_curve"] if acc.get("arith", 0.0) >= 0.85]
    console = log.read_text(errors="replace")
    engine_log = run_dir / "logs" / "engine-0.log"
    engine_text = engine_log.read_text(errors="replace") if engine_log.is_file() else ""
    return {"to_85_s": first[0] if first else None, "completions_per_s":
            summary["completions_per_s"], "wall_s": wall,
            "best_eval": max((acc.get("arith", 0.0) for _, _, acc in summary["eval_curve"]),
                             default=None),
            "iterations": summary.get("iteration"),
            "routes": sorted(set(re.findall(r"weight transport to \S+: ([^\n]+)", console))),
            "graph_captures": engine_text.count("captured the decode step"),
            "tracebacks": console.count("Traceback") + engine_text.count("Traceback")}  # fmt: skip


def run_section(args: argparse.Namespace, tmp: Path) -> list[Row]:
    """Per mode: run.sh with --colocate on --device, then as `make run` on the CPU. A refused
    --colocate ends the section at once: every row says why, nothing else runs."""
    where = "GPU" if args.device == "cuda" else "CPU"
    rows = []
    for mode, label in (("train", "sync"), ("train-async", "async")):
        names = (f"arith {label}, {where} --colocate", f"arith {label}, CPU as `make run`")
        got = {}
        for on_device, name in list(zip((True, False), names, strict=True))[
            : 1 if args.no_cpu_run else 2
        ]:
            progress(f"run: {name}, {args.arith_rollouts} rollouts ...")
            try:
                got[name] = arith_run(mode, on_device, args, tmp)
            except Refused as why:
                return [Row("run", f"arith {m}, {where} --colocate", None, "s to 85%",
                            note=f"not run: {why}") for m in ("sync", "async")]  # fmt: skip
            except (RuntimeError, OSError) as err:
                got[name] = {"error": str(err)}
        cpu = got.get(names[1], {})
        for name, r in got.items():
            if "error" in r:
                rows.append(Row("run", name, None, "s to 85%", note=f"failed: {r['error']}"))
                continue
            t, cps = r["to_85_s"], r["completions_per_s"]
            ratio = cpu["to_85_s"] / t if t and cpu.get("to_85_s") else None
            detail = f"{cps:.0f} completions/s"
            if cpu.get("completions_per_s"):
                detail += f" ({cps / cpu['completions_per_s']:.2f}x CPU's)"
            rows.append(Row("run", name, t, "s to 85%", ratio, "CPU (speed-up)",
                            f"{detail}; command {r['wall_s']:.0f} s", extra=r,
                            note="" if t else "85% not reached"))  # fmt: skip
    return rows


# -- table ----------------------------------------------------------------------------------


def goals(rows: list[Row]) -> list[dict[str, Any]]:
    """The goals (GOALS) of the rows measured: each with its row, target, measured, met."""

    def goal(name: str, row: Row, at_least: bool, bound: float, got: float, unit: str) -> dict:
        met = got >= bound if at_least else got <= bound
        target = f"{'>=' if at_least else '<='} {bound:g}{unit}"
        return {"name": name, "row": row.name, "target": target, "measured": got, "unit": unit,
                "met": met}  # fmt: skip

    measured = [r for r in rows if r.value is not None]
    out = []
    for r in measured:
        if r.name == "millstream torch, --bf16":
            out.append(goal("train step, --bf16 vs the plain bf16 loop", r, True,
                            GOALS["train"], r.ratio, "x"))  # fmt: skip
    engine = [r for r in measured
              if r.section == "engine" and "concurrency" in r.extra
              and not r.extra.get("fp8") and r.extra.get("graphs", True)]  # fmt: skip
    if engine:
        top = max(engine, key=lambda r: r.extra["concurrency"])
        out.append(goal(f"engine at concurrency {top.extra['concurrency']} vs HF generate", top,
                        True, GOALS["engine"], top.ratio, "x"))  # fmt: skip
    for r in measured:
        if r.extra.get("decode_pool") == POOL_PER_ROW[1] and r.ratio is not None:
            out.append(goal("decode step, large pool vs small", r, False, GOALS["decode_pool"],
                            r.ratio, "x"))  # fmt: skip
        if r.extra.get("fp8") and r.extra.get("vs_bf16") is not None:
            out.append(goal("FP8 engine vs the bf16 engine", r, True, GOALS["fp8"],
                            r.extra["vs_bf16"], "x"))  # fmt: skip
    for r in measured:
        if r.section == "sync" and "route" in r.extra:
            out.append(goal("colocated weight update, ms per GB", r, False,
                            GOALS["sync_ms_per_gb"], r.extra["ms_per_gb"], " ms/GB"))  # fmt: skip
    return out


def num(x: float) -> str:
    """Three significant digits or more: 12,345 / 123 / 1.23 / 0.0123."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3g} MB"


def print_table(res: dict[str, Any], rows: list[Row], goal_rows: list[dict]) -> None:
    print(f"device: {res['device_name']}; torch {res['torch']}, transformers "
          f"{res['transformers']}; commit {res['commit']}; {res['cpu_model']}, "
          f"{res['cores_usable']} of {res['cores_total']} cores, {res['memory_gib']:g} GiB")  # fmt: skip
    print(f"model: {res['model']}")
    by_row = {g["row"]: g for g in goal_rows}
    print("| section | measurement | value | ratio | goal |")
    print("|---|---|---|---|---|")
    for r in rows:
        value = (r.note or "-") if r.value is None else f"{num(r.value)} {r.unit}"
        if r.value is not None and r.note:
            value += f" ({r.note})"
        if r.detail:
            value += f"; {r.detail}"
        ratio = "-"
        if r.ratio is not None:
            ratio = f"{r.ratio:.2f}x {r.base}" if r.ratio < 100 else f"{num(r.ratio)}x {r.base}"
        g = by_row.get(r.name)
        goal = (
            f"{g['target']}: {num(g['measured'])}{g['unit']}, {'met' if g['met'] else 'NOT met'}"
            if g
            else ""
        )
        print(f"| {r.section} | {r.name} | {value} | {ratio} | {goal} |")


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="the tiny model and sizes (smoke)")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help="comma list of " + ", ".join(SECTIONS)
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results here")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads here and the engine's --num-threads")  # fmt: skip
    sizes = parser.add_argument_group("sizes (default: full / --small)")
    for name, (full, small) in SIZES.items():
        kind = str if isinstance(full, str) else int
        sizes.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None,
                           help=f"{full} / {small}")  # fmt: skip
    parser.add_argument("--log-probs-chunk-size", type=int, default=0,
                        help="passed to millstream's backend (0: not passed)")  # fmt: skip
    parser.add_argument("--mem-fraction-static", type=float, default=0.5)
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None,
                        help="default: the highest --concurrency")  # fmt: skip
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--no-fp8", action="store_true",
                        help="skip the engine's FP8 row (an FP8 copy of the model)")  # fmt: skip
    parser.add_argument("--bucket-mb", type=int, default=512, help="the sync's bucket size")
    parser.add_argument("--arith-rollouts", type=int, default=90, help="run.sh's NUM_ROLLOUT")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run.sh")
    parser.add_argument("--no-cpu-run", action="store_true",
                        help="run: only the --colocate runs on --device, not the CPU's")  # fmt: skip
    args = parser.parse_args(argv)
    for name, (full, small) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.only = args.only.split(",")
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.batch % min(GROUP, args.batch) or args.seq_len < 4:
        parser.error(f"--batch must be a multiple of {GROUP} (or less), --seq-len >= 4")
    return args


def git_commit() -> str:
    """`git rev-parse --short HEAD`, with +dirty when the tree has changes; where there is no
    git or no .git (a copied tree on a GPU machine), $MILLSTREAM_COMMIT, else "unknown"."""

    def git(*argv: str) -> str | None:
        try:
            proc = subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                                  check=False, timeout=30)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return os.environ.get("MILLSTREAM_COMMIT") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain") else "")


def resources(args: argparse.Namespace, params: int) -> dict[str, Any]:
    import torch
    import transformers
    from proctree import machine

    name = (torch.cuda.get_device_name() if args.device == "cuda"
            else f"CPU, {torch.get_num_threads()} threads")  # fmt: skip
    shape = TINY if args.small else QWEN2_05B
    model = (f"Qwen2{' (tiny, --small)' if args.small else '-0.5B shape'}: hidden "
             f"{shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
             f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, vocabulary "
             f"{shape['vocab_size']}, random init; {params / 1e6:.1f}M parameters")  # fmt: skip
    return machine() | {"device": args.device, "device_name": name, "torch": torch.__version__,
                        "transformers": transformers.__version__, "commit": git_commit(),
                        "threads": args.threads, "model": model}  # fmt: skip


def engine_and_sync(model_dir: Path, args: argparse.Namespace, tmp: Path) -> list[Row]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.router_proc import ServiceProcess

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    rows = []
    if "engine" in args.only:
        progress(f"engine: HF generate, {args.hf_batch} x {args.new_tokens} tokens ...")
        made, seconds = hf_generate(model, args)
        rows.append(Row("engine", f"HF generate bf16, {args.hf_batch} prompts x "
                        f"{args.new_tokens} tokens in one batch", made / seconds, "tokens/s",
                        1.0, "HF generate", extra={"tokens": made, "seconds": seconds}))  # fmt: skip
    free_memory(args.device)
    progress("starting millstream engine ...")
    flags = engine_flags(args)
    engine = ServiceProcess("engine", ["--model-path", str(model_dir), *flags], tmp)
    router = None
    try:
        engine.wait_ready("/health", timeout_s=600)
        if "engine" in args.only:
            rows = engine_section(engine.url, rows[0], args)
        if "sync" in args.only:
            router = ServiceProcess("router", ["--worker-urls", engine.url], tmp)
            router.wait_ready("/health")
            rows += sync_section(model, router.url, args)
    finally:
        for proc in (router, engine):
            if proc is not None:
                proc.stop()
    for r in rows:
        if r.section == "engine":
            r.extra["engine_flags"] = flags
    if "engine" in args.only and args.device == "cuda" and not args.disable_cuda_graph:
        rows += variant_engine_rows(model_dir, rows, args, tmp, graphs=False)
    if "engine" in args.only and not args.no_fp8:
        rows += variant_engine_rows(model_dir, rows, args, tmp, graphs=None)
    if "engine" in args.only:
        rows += decode_step_rows(model_dir, args)
    return rows


def variant_engine_rows(
    model_dir: Path, rows: list[Row], args: argparse.Namespace, tmp: Path, graphs: bool | None
) -> list[Row]:
    """The engine once more at the highest concurrency, as a variant of the rows measured:
    `graphs` False, the bf16 engine with --disable-cuda-graph (eager decoding over the live
    columns); None, the FP8 engine on an FP8 copy of the model (examples/arith/make_fp8.py:
    e4m3 weights with 128 x 128 block scales, engine/fp8.py). Ratio to HF generate; to the
    bf16 engine with graphs in the note."""
    from bench_engine import engine_run

    from tests.support.router_proc import ServiceProcess

    conc = max(args.concurrency)
    hf = rows[0].value or 1.0
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
        made, seconds = asyncio.run(
            engine_run(engine.url, prompts(count, args.prompt_tokens, conc), args.new_tokens, conc)
        )
    finally:
        engine.stop()
    tps = made / seconds
    note = f"{tps / bf16:.2f}x the bf16 engine" + (" with graphs" if graphs is False else "")
    return [Row("engine", label, tps, "tokens/s", tps / hf, "HF generate",
                note=note if bf16 else "",
                extra={"tokens": made, "seconds": seconds, "concurrency": conc,
                       "engine_flags": flags, "vs_bf16": tps / bf16 if bf16 else None,
                       **extra})]  # fmt: skip


def make_fp8_copy(model_dir: Path, tmp: Path) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_fp8", ARITH / "make_fp8.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_fp8(model_dir, tmp / "model-fp8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # this process and every service it starts
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no GPU here (--device cpu for the CPU smoke run)")
    torch.set_num_threads(args.threads)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        progress("building the model ...")
        model_dir, params = build_model_dir(tmp / "model", args.small, args.device)
        res = resources(args, params)
        vocab = (TINY if args.small else QWEN2_05B)["vocab_size"]
        if "train" in args.only:
            rows += train_section(model_dir, args, vocab)
        if {"engine", "sync"} & set(args.only):
            try:
                rows += engine_and_sync(model_dir, args, tmp)
            except (RuntimeError, OSError) as err:  # the train rows stand; the table says why
                lines = str(err).strip().splitlines()
                why = f"failed: {lines[0]} ... {lines[-1]}"
                rows += [Row(section, "millstream engine", None, "", note=why)
                         for section in ("engine", "sync") if section in args.only]  # fmt: skip
                progress(f"engine/sync failed: {err}")
        free_memory(args.device)
        if "run" in args.only:
            rows += run_section(args, tmp)
    goal_rows = goals(rows)
    print_table(res, rows, goal_rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"resources": res, "settings": settings,
                                         "rows": [asdict(r) for r in rows],
                                         "goals": goal_rows}, indent=1))  # fmt: skip
        progress(f"wrote {args.json}")
    return 1 if any(r.note.startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
