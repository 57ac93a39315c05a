"""Greedy accuracy and pass@k of a model directory on the arith eval set, with plain HF generate.

    .venv/bin/python examples/arith/eval_model.py [--model DIR] [--data eval.jsonl] [--k 8]

greedy    share of problems whose greedy response is exactly the label
pass@k    share of problems with at least one of k samples (temperature, full vocabulary) right
sample    share of all k * problems samples that are right (the mean GRPO reward at start)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from task import DATA_DIR, MODEL_DIR, exact_match, read_jsonl

# The longest answer is 3 digits, then eos: anything longer is wrong anyway.
MAX_NEW_TOKENS = 4


def load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.eval()
    return model, tokenizer


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    n: int = 1,
    temperature: float = 0.0,
    batch_size: int = 512,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """n responses per prompt (prompt-major order), decoded up to eos without special tokens."""
    import torch

    tokenizer.padding_side = "left"
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    expanded = [p for p in prompts for _ in range(n)]
    out: list[str] = []
    with torch.inference_mode():
        for start in range(0, len(expanded), batch_size):
            chunk = expanded[start : start + batch_size]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            ids = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **sampling,
            )
            new = ids[:, enc["input_ids"].shape[1] :]
            out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return out


def evaluate(
    model: Any,
    tokenizer: Any,
    rows: list[dict],
    *,
    k: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
) -> dict[str, float]:
    import torch

    prompts = [r["prompt"] for r in rows]
    labels = [r["label"] for r in rows]
    greedy = generate(model, tokenizer, prompts)
    greedy_acc = sum(exact_match(g, y) for g, y in zip(greedy, labels, strict=True)) / len(rows)
    result = {"greedy": greedy_acc}
    if k > 0:
        torch.manual_seed(seed)
        samples = generate(model, tokenizer, prompts, n=k, temperature=temperature)
        right = [exact_match(s, labels[i // k]) for i, s in enumerate(samples)]
        hits = [any(right[i * k : (i + 1) * k]) for i in range(len(rows))]
        result[f"pass@{k}"] = sum(hits) / len(rows)
        result["sample"] = sum(right) / len(right)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--data", type=Path, default=DATA_DIR / "eval.jsonl")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load(args.model)
    rows = read_jsonl(args.data)
    res = evaluate(model, tokenizer, rows, k=args.k, temperature=args.temperature, seed=args.seed)
    took = time.perf_counter() - start
    k = args.k
    line = f"{args.model}: {len(rows)} problems | greedy {res['greedy']:.1%}"
    if k > 0:
        line += (
            f" | pass@{k} {res[f'pass@{k}']:.1%} (T={args.temperature:g})"
            f" | sample {res['sample']:.1%}"
        )
    print(f"{line} | {took:.1f}s")


if __name__ == "__main__":
    main()
