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
run     examples/arith/run.sh (`make run`) in each of --arith-modes (sync: MODE=train, async)
        with --colocate on --device (the engine's pool capped at --arith-max-total-tokens),
        and as `make run` runs it on the CPU (no GPU visible): seconds from the trainer's
        start to the first greedy eval >= 85% and completions/s (the trainer's summary.json),
        the weight transport its start-up line chose, and the engine's CUDA graph captures.
        "not run: <why>" where --colocate is refused; --no-cpu-run leaves out the CPU runs
        (make gpu-check: the GPU's async row only, gpu_bench_run.py).

Decode step (engine section, in process): 64 rows of 100 tokens decoded over a token pool
sized for 1k tokens a row, then for 32k (as much of it as fits in half the free memory), ms
a step with CUDA graphs on a GPU, beside the weights-read limit (the weights' bytes over the
memory bandwidth a 1 GB device copy reaches): the step must not grow with the pool.

Goals beside the rows: train with --bf16 >= 0.85x the plain bf16 loop; engine >= 5x HF
generate at the highest concurrency (64); the decode step over the 32k pool <= 1.5x the 1k
one; the FP8 engine >= 1.0x the bf16 engine; the colocated weight update <= 20 ms per GB.
Progress goes to stderr, one line per measurement; the table to stdout; --json PATH gets the
resources, settings, rows and goals, rewritten after every row (`done` true once all sections
have run), so a run stopped by `make gpu-check`'s stage limit keeps what it measured.

The engine and sync sections are gpu_bench_engine.py, the run section gpu_bench_run.py, what
they share (the row, the results file) gpu_bench_util.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from gpu_bench_engine import POOL_PER_ROW, engine_and_sync  # noqa: E402
from gpu_bench_run import MODES, run_section  # noqa: E402
from gpu_bench_util import (  # noqa: E402
    ARITH,
    Results,
    Row,
    best_of,
    free_memory,
    num,
    peak_gb,
    progress,
)
from proctree import git_commit  # noqa: E402

SECTIONS = ("train", "engine", "sync", "run")
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
GROUP = 8  # samples per prompt, for the advantages
ARITH_MAX_TOTAL_TOKENS = 16384  # the colocated arith run's pool (gpu_bench_run.py)


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


def train_section(
    model_dir: Path, args: argparse.Namespace, vocab: int, add: Callable[..., None]
) -> None:
    """The plain loop first (the rows after it are ratios to it), each row added when done."""
    from millstream.common.config import parse_run_config

    samples = make_samples(args.batch, args.seq_len, vocab)
    tokens = args.batch * args.seq_len
    shape = f"{args.batch} x {args.seq_len} tokens, micro-batch {args.micro_batch_size}"

    def row(name: str, seconds: float, plain: float) -> Row:
        peak = peak_gb(args.device)
        return Row("train", name, tokens / seconds, "tokens/s", plain / seconds, "plain loop",
                   f"peak {peak:.1f} GB" if peak is not None else "",
                   extra={"seconds": seconds, "peak_gb": peak})  # fmt: skip

    progress(f"train: plain bf16 loop, {shape} ...")
    free_memory(args.device)
    loop = PlainBf16Loop(model_dir, samples, parse_run_config(millstream_flags(args, False)), args)
    plain = best_of(loop.step, args.repeats, args.device)
    add(row(f"plain bf16 loop (bf16 params, fp32 AdamW masters), {shape}", plain, plain))
    del loop
    for name, bf16 in (("millstream torch, fp32", False), ("millstream torch, --bf16", True)):
        progress(f"train: {name}, {shape} ...")
        free_memory(args.device)
        seconds, _ = time_millstream(model_dir, samples, args, bf16)
        add(row(name, seconds, plain))
    free_memory(args.device)


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
    parser.add_argument("--arith-modes", default="sync,async",
                        help="run: comma list of " + ", ".join(MODES))  # fmt: skip
    parser.add_argument("--arith-max-total-tokens", type=int, default=ARITH_MAX_TOTAL_TOKENS,
                        help="run: the colocated engine's pool (0: its own size)")  # fmt: skip
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="run: where the runs and their logs stay (a temp dir)")  # fmt: skip
    args = parser.parse_args(argv)
    for name, (full, small) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else full)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.only = args.only.split(",")
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    args.arith_modes = [m for m in args.arith_modes.split(",") if m]
    if set(args.arith_modes) - set(MODES):
        parser.error(f"--arith-modes: choose from {', '.join(MODES)}")
    if args.batch % min(GROUP, args.batch) or args.seq_len < 4:
        parser.error(f"--batch must be a multiple of {GROUP} (or less), --seq-len >= 4")
    return args


def resources(args: argparse.Namespace, params: int | None) -> dict[str, Any]:
    import torch
    import transformers
    from proctree import machine

    name = (torch.cuda.get_device_name() if args.device == "cuda"
            else f"CPU, {torch.get_num_threads()} threads")  # fmt: skip
    shape = TINY if args.small else QWEN2_05B
    model = (f"Qwen2{' (tiny, --small)' if args.small else '-0.5B shape'}: hidden "
             f"{shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
             f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, vocabulary "
             f"{shape['vocab_size']}, random init; {params / 1e6:.1f}M parameters"
             if params is not None else "not built (--only run: the arith job's own model)")  # fmt: skip
    return machine() | {"device": args.device, "device_name": name, "torch": torch.__version__,
                        "transformers": transformers.__version__, "commit": git_commit(),
                        "threads": args.threads, "model": model}  # fmt: skip


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
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results = Results(args.json, settings, goals)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        params = model_dir = None
        if {"train", "engine", "sync"} & set(args.only):  # the run section has its own model
            progress("building the model ...")
            model_dir, params = build_model_dir(tmp / "model", args.small, args.device)
        results.resources = resources(args, params)
        results.write()
        vocab = (TINY if args.small else QWEN2_05B)["vocab_size"]
        if "train" in args.only:
            train_section(model_dir, args, vocab, results.add)
        if {"engine", "sync"} & set(args.only):
            try:
                engine_and_sync(model_dir, args, tmp, results.rows, results.add)
            except (RuntimeError, OSError) as err:  # the rows so far stand; the table says why
                lines = str(err).strip().splitlines()
                why = f"failed: {lines[0]} ... {lines[-1]}"
                failed = [s for s in ("engine", "sync") if s in args.only]
                results.add(*[Row(s, "millstream engine", None, "", note=why) for s in failed])
                progress(f"engine/sync failed: {err}")
        free_memory(args.device)
        if "run" in args.only:
            run_dir = args.run_dir or tmp
            run_dir.mkdir(parents=True, exist_ok=True)
            run_section(args, run_dir, results.add)
    results.write(done=True)
    print_table(results.resources, results.rows, goals(results.rows))
    if args.json:
        progress(f"wrote {args.json}")
    return 1 if any(r.note.startswith("failed") for r in results.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
