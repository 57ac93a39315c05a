"""Train-step throughput: dynamic batching (packed rows under --max-tokens-per-gpu) vs fixed
micro-batches (--micro-batch-size, padded), side by side in one run.

    .venv/bin/python bench/bench_train_step.py [--samples 64] [--hidden 256] [--layers 4]

Builds a random Qwen2 model in a temp dir and a rollout of samples with a long-tailed
response length (most short, a few long: what RL on reasoning tasks gives), then times
`TorchBackend.train_rollout` (one GRPO step: forward, backward, optimizer) for each layout on
the same samples. Prints tokens/s (real tokens, padding not counted), the share of padding
the layout computed, and the ratio to the first row. The gradient is the same for all of
them (tests/unit/test_estimators_backend.py); only speed and memory differ.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def make_samples(n: int, seed: int = 0) -> list:
    from millstream.trainer.backends.base import TrainSample

    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        prompt = rng.randint(16, 48)
        response = min(480, int(rng.paretovariate(1.2) * 24))  # long tail
        tokens = [rng.randrange(32, 127) for _ in range(prompt + response)]
        samples.append(
            TrainSample(
                tokens=tokens, prompt_len=prompt, loss_mask=[1] * response,
                rollout_logprobs=[-4.0] * response, reward=rng.choice([-1.0, 1.0]),
            )
        )  # fmt: skip
    return samples


def padded_tokens(backend, samples: list) -> int:
    """Tokens the layout runs through the model, padding included."""
    total = 0
    for rows in backend._micro_batches(samples):
        lengths = [len(samples[i].tokens) for i in rows]
        total += (
            sum(lengths) if backend.cfg.perf.use_dynamic_batch_size else max(lengths) * len(rows)
        )
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from millstream.common.config import parse_run_config
    from millstream.trainer.backends.torch_backend import TorchBackend
    from tests.support.tiny_model import build_tiny_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    samples = make_samples(args.samples)
    real = sum(len(s.tokens) for s in samples)
    longest = max(len(s.tokens) for s in samples)
    layouts = {
        "fixed micro-batch 8 (padded)": ["--micro-batch-size", "8"],
        "fixed micro-batch 1": ["--micro-batch-size", "1"],
        f"dynamic, cap {longest} tokens": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(longest)],
        f"dynamic, cap {2 * longest} tokens": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(2 * longest)],
    }  # fmt: skip
    print(f"{args.samples} samples, {real} tokens, longest {longest}; "
          f"model hidden {args.hidden}, {args.layers} layers")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp), hidden_size=args.hidden, num_layers=args.layers)
        rows = []
        for name, flags in layouts.items():
            cfg = parse_run_config(
                ["--rollout-batch-size", str(args.samples), "--n-samples-per-prompt", "1",
                 "--disable-grpo-std-normalization", "--lr", "1e-6", *flags]
            )  # fmt: skip
            backend = TorchBackend(cfg, model_dir, ref_dir=None, total_steps=args.repeats + 1)
            backend.train_rollout(samples[:8], 1)  # warm-up
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                backend.train_rollout(samples, 1)
                best = min(best, time.perf_counter() - start)
            computed = padded_tokens(backend, samples)
            rows.append((name, real / best, 1 - real / computed))
    base = rows[0][1]
    print(f"{'layout':<34} {'tokens/s':>10} {'padding':>8} {'ratio':>7}")
    for name, rate, padding in rows:
        print(f"{name:<34} {rate:>10.0f} {padding:>7.0%} {rate / base:>6.2f}x")


if __name__ == "__main__":
    main()
