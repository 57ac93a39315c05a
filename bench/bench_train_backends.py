"""Trainer backends side by side: one GRPO rollout of the same batch on each, in one run.

    .venv/bin/python bench/bench_train_backends.py [--samples 64] [--hidden 256] [--layers 4]

Builds a random Qwen2 model in a temp dir and a rollout of samples with a long-tailed response
length (bench_train_step.py's), then times `train_rollout` (forward, backward, optimizer
step; the no-grad forwards the estimator needs) on:

- torch, 1 rank: TorchBackend in this process, with every core (--threads, default 2);
- torch DDP, 2 ranks: two gloo processes under DataParallel (trainer/backends/distributed.py: rank 0
  broadcasts the samples, each rank trains its share, torch's DistributedDataParallel sums
  the gradients), the cores split between them (--threads / 2 each), as `torchrun
  --nproc-per-node 2` of `millstream train` would run them;
- torch FSDP2, 2 ranks: the same with `--train-backend fsdp` (the actor sharded with
  fully_shard, its full weights gathered to rank 0 after the rollout, as for a weight sync);
- megatron TP=1, 1 rank: `--train-backend megatron`, and on a GPU again with
  `--use-distributed-optimizer` (megatron's DDP and distributed optimizer);
- megatron TP=2, 2 ranks: `--train-backend megatron --tensor-model-parallel-size 2`, both
  ranks on every sample, each with half of every layer, the weights gathered after the rollout;
- megatron PP=2, 2 ranks: `--pipeline-model-parallel-size 2`, each rank half of the layers
  (megatron/pipeline.py: the stages one after another, not overlapped).

Prints tokens/s of the best of --repeats rollouts (real tokens, padding not counted), each
rank's peak RSS (the process's high-water mark: the model, its gradients and Adam state,
activations), and the ratio to the first row. The one-rank Megatron row runs in a process of its
own (megatron's process group and CPU patches).

Where torch sees a GPU the backends train on it (NCCL between ranks, one GPU per rank): the
memory column is then each rank's peak GPU memory allocated once the backend is built, and
with one GPU only the one-rank rows run (NCCL refuses two ranks on one device: "Duplicate GPU
detected"). The README's H100 table: `--samples 256 --hidden 1024 --layers 8 --max-tokens
2048` (at 8192 the torch row's unfused attention over a packed row outgrows 80 GB).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

FLAGS = ["--n-samples-per-prompt", "1", "--disable-grpo-std-normalization", "--lr", "1e-6",
         "--use-dynamic-batch-size"]  # fmt: skip


def _peak_mb() -> float:
    """This rank's peak memory: GPU memory allocated on a GPU, else the process's RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """On a GPU, the peak from here on: training's, not the model's conversion at the start."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _best_seconds(train_rollout, samples: list, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """The fastest of `repeats` one-step rollouts of `samples`, after a small warm-up one."""
    import torch

    def timed() -> float:
        start = time.perf_counter()
        train_rollout(samples, 1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    train_rollout(samples[:8], 1)
    return min(timed() for _ in range(repeats))


def _config(samples: int, backend: str = "torch"):
    """`backend`: torch, fsdp, megatron, megatron-tp2, megatron-pp2 (megatron, tensor or
    pipeline parallel 2) or megatron-distopt (--use-distributed-optimizer)."""
    from millstream.common.config import parse_run_config

    name, _, parallel = backend.partition("-")
    kind = {"tp2": "tensor", "pp2": "pipeline"}.get(parallel)
    extra = [f"--{kind}-model-parallel-size", "2"] if kind else []
    if parallel == "distopt":
        extra = ["--use-distributed-optimizer"]
    return parse_run_config(["--rollout-batch-size", str(samples), "--train-backend", name,
                             *extra, *FLAGS, "--max-tokens-per-gpu",
                             os.environ.get("BENCH_MAX_TOKENS", "1024")])  # fmt: skip


def one_rank(model_dir: Path, samples: list, repeats: int, threads: int) -> tuple[float, list]:
    import torch

    from millstream.trainer.backends.torch_backend import TorchBackend

    torch.set_num_threads(threads)
    backend = TorchBackend(_config(len(samples)), model_dir, ref_dir=None, total_steps=repeats + 2)
    _reset_peak()
    return _best_seconds(backend.train_rollout, samples, repeats), [_peak_mb()]


def _ddp_rank(rank: int, world: int, port: int, model_dir: str, samples: list, repeats: int,
              threads: int, backend_name: str, out: dict) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist

    from millstream.trainer.backends.distributed import DataParallel, init, send_stop, shutdown
    from millstream.trainer.backends.torch_backend import TorchBackend

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # fmt: skip
    init()
    try:
        cls = TorchBackend
        if backend_name.startswith("megatron"):
            from millstream.trainer.backends.megatron.backend import MegatronBackend

            cls = MegatronBackend
        backend = cls(
            _config(len(samples), backend_name), model_dir, ref_dir=None, total_steps=repeats + 2
        )
        dp = DataParallel(backend)
        _reset_peak()
        if rank == 0:
            out["seconds"] = _best_seconds(dp.train_rollout, samples, repeats)
            send_stop()
        else:
            dp.follow()
        rss = torch.tensor([_peak_mb()], dtype=torch.float64)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, rss)
        if rank == 0:
            out["rss"] = [float(t) for t in gathered]
    finally:
        shutdown()


def _megatron_rank(rank: int, model_dir: str, samples: list, repeats: int, threads: int,
                   name: str, out: dict) -> None:  # fmt: skip
    from millstream.trainer.backends.megatron.backend import MegatronBackend

    torch_threads(threads)
    cfg = _config(len(samples), name)
    backend = MegatronBackend(cfg, model_dir, ref_dir=None, total_steps=repeats + 2)
    _reset_peak()
    out["seconds"] = _best_seconds(backend.train_rollout, samples, repeats)
    out["rss"] = [_peak_mb()]


def torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def megatron(
    model_dir: Path, samples: list, repeats: int, threads: int, name: str = "megatron"
) -> tuple[float, list]:
    """One rank in a process of its own (megatron's process group and CPU patches)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_megatron_rank, args=(str(model_dir), samples, repeats, threads, name, out),
                 nprocs=1)  # fmt: skip
        return out["seconds"], list(out["rss"])


def ddp(
    model_dir: Path, samples: list, repeats: int, threads: int, backend: str = "torch"
) -> tuple[float, list]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ddp_rank, args=(2, port, str(model_dir), samples, repeats,
                                  max(1, threads // 2), backend, out), nprocs=2)  # fmt: skip
        return out["seconds"], list(out["rss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--max-tokens", type=int, default=1024, help="--max-tokens-per-gpu")
    args = parser.parse_args()
    os.environ["BENCH_MAX_TOKENS"] = str(args.max_tokens)  # _config's, in every process

    import torch

    gpus = torch.cuda.device_count()

    from bench_train_step import make_samples

    from tests.support.tiny_model import build_tiny_model

    samples = make_samples(args.samples)
    real = sum(len(s.tokens) for s in samples)
    where = f"{torch.cuda.get_device_name()}, fp32" if gpus else f"{args.threads} threads in all"
    print(f"{args.samples} samples, {real} tokens; model hidden {args.hidden}, {args.layers} "
          f"layers; max {args.max_tokens} tokens per micro-batch; {where}")  # fmt: skip
    heads = max(4, args.hidden // 64)
    link = "nccl" if gpus else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp), hidden_size=args.hidden, num_layers=args.layers,
                                     num_heads=heads, num_kv_heads=heads // 2)  # fmt: skip
        rows = [
            ("torch, 1 rank", lambda: one_rank(model_dir, samples, args.repeats, args.threads)),
            (f"torch DDP, 2 ranks ({link})",
             lambda: ddp(model_dir, samples, args.repeats, args.threads)),
            (f"torch FSDP2, 2 ranks ({link})",
             lambda: ddp(model_dir, samples, args.repeats, args.threads, "fsdp")),
            ("megatron TP=1, 1 rank",
             lambda: megatron(model_dir, samples, args.repeats, args.threads)),
            ("megatron TP=1, distributed opt.",
             lambda: megatron(model_dir, samples, args.repeats, args.threads, "megatron-distopt")),
            (f"megatron TP=2, 2 ranks ({link})",
             lambda: ddp(model_dir, samples, args.repeats, args.threads, "megatron-tp2")),
            (f"megatron PP=2, 2 ranks ({link})",
             lambda: ddp(model_dir, samples, args.repeats, args.threads, "megatron-pp2")),
        ]  # fmt: skip
        results: list[tuple[str, float, list[float]] | tuple[str, str]] = []  # or why not
        for name, measure in rows:
            if gpus == 1 and "2 ranks" in name:
                results.append((name, "needs 2 GPUs (NCCL: one GPU per rank)"))
                continue
            if not gpus and "distributed opt." in name:
                continue  # megatron's distributed optimizer runs on GPUs only
            try:
                results.append((name, *measure()))
            except Exception as err:  # one row's failure leaves the others' numbers
                results.append((name, f"failed: {type(err).__name__}: {err}"))
    memory = "peak GPU memory" if gpus else "peak RSS"
    print(f"{'backend':<28} {'tokens/s':>10} {'ratio':>7}  {memory} per rank (MB)")
    base = None
    for name, *result in results:
        if len(result) == 1:
            print(f"{name:<28} {'-':>10} {'-':>7}  {result[0]}")
            continue
        seconds, peaks = result
        rate = real / seconds
        base = base or rate  # the first row measured
        print(f"{name:<28} {rate:>10.0f} {rate / base:>6.2f}x  "
              f"{', '.join(f'{r:.0f}' for r in peaks)}")  # fmt: skip


if __name__ == "__main__":
    main()
