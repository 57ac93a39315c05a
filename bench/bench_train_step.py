"""Train-step throughput: dynamic batching (packed rows under --max-tokens-per-gpu) vs fixed
micro-batches (--micro-batch-size, padded), and the shared-prompt layout vs one row per
sample, side by side in one run.

    .venv/bin/python bench/bench_train_step.py [--samples 64] [--hidden 256] [--layers 4]

Builds a random Qwen2 model in a temp dir and a rollout of samples with a long-tailed
response length (most short, a few long: what RL on reasoning tasks gives), then times
`TorchBackend.train_rollout` (one GRPO step: forward, backward, optimizer) for each layout on
the same samples. Prints tokens/s (real tokens, padding not counted), the tokens the layout
ran through the model per real token (padding makes it more than 1; a prompt forwarded once
for its samples, less), and the ratio to the first row. The gradient is the same for all of
them (tests/unit/trainer/backends/test_estimators_backend.py); only speed and memory differ.

The second table is GRPO's shape: --prompts prompts of --prompt-len tokens with --group
samples each, one micro-batch, forwarded one row per sample (--no-shared-prefix) or each
prompt once for its samples (the default, shared_prefix.py), and the same packed into rows of
at most --pack-cap tokens (--use-dynamic-batch-size), for short answers and for long-tailed
ones.
(tests/unit/trainer/backends/test_shared_prefix.py: the same logprobs and gradient.)
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


def long_tail(rng: random.Random) -> int:
    return min(480, int(rng.paretovariate(1.2) * 24))


def make_samples(n: int, seed: int = 0) -> list:
    from millstream.trainer.backends.base import TrainSample

    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        prompt = rng.randint(16, 48)
        response = long_tail(rng)
        tokens = [rng.randrange(32, 127) for _ in range(prompt + response)]
        samples.append(
            TrainSample(
                tokens=tokens, prompt_len=prompt, loss_mask=[1] * response,
                rollout_logprobs=[-4.0] * response, reward=rng.choice([-1.0, 1.0]),
            )
        )  # fmt: skip
    return samples


def make_groups(prompts: int, group: int, prompt_len: int, response_len, seed: int = 0) -> list:
    """`prompts` prompts of `prompt_len` tokens, `group` samples each, responses of
    `response_len(rng)` tokens."""
    from millstream.trainer.backends.base import TrainSample

    rng = random.Random(seed)
    samples = []
    for _ in range(prompts):
        prompt = [rng.randrange(32, 127) for _ in range(prompt_len)]
        for _ in range(group):
            response = [rng.randrange(32, 127) for _ in range(response_len(rng))]
            samples.append(
                TrainSample(
                    tokens=prompt + response, prompt_len=prompt_len,
                    loss_mask=[1] * len(response), rollout_logprobs=[-4.0] * len(response),
                    reward=rng.choice([-1.0, 1.0]),
                )
            )  # fmt: skip
    return samples


def padded_tokens(backend, samples: list) -> int:
    """Tokens the layout runs through the model, padding included."""
    from millstream.trainer.backends import shared_prefix

    total = 0
    for rows in backend._micro_batches(samples):
        mb = [samples[i] for i in rows]
        lengths = [len(s.tokens) for s in mb]
        shared = backend._prompt_rows(mb)
        if shared is None and backend.cfg.perf.use_dynamic_batch_size:
            total += sum(lengths)
        elif shared is not None:  # a row per prompt, or (packed) every prompt's in one row
            rows = [shared_prefix.row_length(mb, r) for r in shared]
            packed = backend.cfg.perf.use_dynamic_batch_size
            total += sum(rows) if packed else len(shared) * max(rows)
        else:
            total += max(lengths) * len(rows)
    return total


def time_layouts(model_dir, samples: list, layouts: dict, repeats: int, base_flags: list) -> list:
    """(name, real tokens/s, tokens run per real token) per layout: the best of `repeats`
    steps."""
    from millstream.common.config import parse_run_config
    from millstream.trainer.backends.torch_backend import TorchBackend

    real = sum(len(s.tokens) for s in samples)
    rows = []
    for name, flags in layouts.items():
        cfg = parse_run_config([*base_flags, *flags])
        backend = TorchBackend(cfg, model_dir, ref_dir=None, total_steps=repeats + 1)
        backend.train_rollout(samples[:8], 1)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            backend.train_rollout(samples, 1)
            best = min(best, time.perf_counter() - start)
        rows.append((name, real / best, padded_tokens(backend, samples) / real))
    return rows


def print_rows(rows: list) -> None:
    base = rows[0][1]
    print(f"{'layout':<40} {'tokens/s':>10} {'run/real':>8} {'ratio':>7}")
    for name, rate, run in rows:
        print(f"{name:<40} {rate:>10.0f} {run:>8.2f} {rate / base:>6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--pack-cap", type=int, default=1024, help="--max-tokens-per-gpu")
    args = parser.parse_args()

    import torch

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
        base = ["--rollout-batch-size", str(args.samples), "--n-samples-per-prompt", "1",
                "--disable-grpo-std-normalization", "--lr", "1e-6"]  # fmt: skip
        print_rows(time_layouts(model_dir, samples, layouts, args.repeats, base))
        n = args.prompts * args.group
        base = ["--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt",
                str(args.group), "--lr", "1e-6", "--micro-batch-size", str(n)]  # fmt: skip
        shapes = {
            "answers of 4-16 tokens": lambda rng: rng.randint(4, 16),
            "long-tailed answers": long_tail,
        }
        for shape, response_len in shapes.items():
            grouped = make_groups(args.prompts, args.group, args.prompt_len, response_len)
            print(f"\n{args.prompts} prompts of {args.prompt_len} tokens x {args.group} samples, "
                  f"{shape}: {sum(len(s.tokens) for s in grouped)} tokens, one micro-batch")  # fmt: skip
            cap = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.pack_cap)]
            layouts = {"one row per sample (--no-shared-prefix)": ["--no-shared-prefix"],
                       "shared prompts (default)": [],
                       f"packed, cap {args.pack_cap} (--no-shared-prefix)": [*cap, "--no-shared-prefix"],
                       f"packed, cap {args.pack_cap}, shared prompts": cap}  # fmt: skip
            print_rows(time_layouts(model_dir, grouped, layouts, args.repeats, base))


if __name__ == "__main__":
    main()
