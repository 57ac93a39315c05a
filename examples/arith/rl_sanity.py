"""In-process GRPO on the arith task with plain HF + torch: calibration evidence, not the product.

    .venv/bin/python examples/arith/rl_sanity.py [--model DIR] [--lr 5e-4] [--prompts 64] [--n 8]

One process, no services: sample n responses per prompt at temperature 1 with HF generate,
reward = exact match, GRPO advantages (reward - group mean) / (group std + 1e-6), loss =
-mean over samples of advantage * (mean token logprob of the response, eos included), one Adam
step per rollout (so the PPO ratio is 1 and clipping never bites). Greedy accuracy on
eval.jsonl every --eval-interval steps, printed against the wall-clock seconds spent on
training (generation + update, evaluation excluded) and in total. The real run goes through
millstream's services (engine, router, rollout and reward workers, trainer), which add
overhead; this loop says how many steps and samples the task needs from the shipped model.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_model import MAX_NEW_TOKENS, generate, load
from task import DATA_DIR, MODEL_DIR, exact_match, read_jsonl


def greedy_accuracy(model, tokenizer, rows) -> float:
    responses = generate(model, tokenizer, [r["prompt"] for r in rows])
    right = [exact_match(s, r["label"]) for s, r in zip(responses, rows, strict=True)]
    return sum(right) / len(rows)


def rollout(model, tokenizer, prompts, n, temperature):
    """(input ids [B*n, P+R], prompt width P, response mask [B*n, R]); B*n = prompts * n."""
    import torch

    tokenizer.padding_side = "left"
    enc = tokenizer(
        [p for p in prompts for _ in range(n)],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    with torch.inference_mode():
        ids = model.generate(
            **enc,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    width = enc["input_ids"].shape[1]
    response = ids[:, width:]
    is_eos = response == tokenizer.eos_token_id
    # Every token up to and including the first eos; nothing after it (padding).
    after_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    mask = (~after_eos).float()
    attention = torch.cat([enc["attention_mask"], torch.ones_like(response)], dim=1)
    return ids.clone(), attention, width, mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--train", type=Path, default=DATA_DIR / "train.jsonl")
    parser.add_argument("--eval", type=Path, default=DATA_DIR / "eval.jsonl")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per rollout")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-interval", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.9, help="stop at this greedy acc")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the curve here")
    parser.add_argument("--save", type=Path, help="save the trained model here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model, tokenizer = load(args.model)
    train_rows, eval_rows = read_jsonl(args.train), read_jsonl(args.eval)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    start = time.perf_counter()
    eval_seconds = 0.0
    cpu_start = time.process_time()
    curve = [{"step": 0, "train_s": 0.0, "total_s": 0.0, "greedy": 0.0, "reward": None}]
    curve[0]["greedy"] = greedy_accuracy(model, tokenizer, eval_rows)
    eval_seconds = time.perf_counter() - start
    print(f"step 0: greedy {curve[0]['greedy']:.1%}", flush=True)

    order: list[dict] = []
    completions = 0
    for step in range(1, args.max_steps + 1):
        if len(order) < args.prompts:
            fresh = list(train_rows)
            rng.shuffle(fresh)
            order.extend(fresh)
        batch, order = order[: args.prompts], order[args.prompts :]

        model.eval()
        ids, attention, width, mask = rollout(
            model, tokenizer, [r["prompt"] for r in batch], args.n, args.temperature
        )
        texts = tokenizer.batch_decode(ids[:, width:], skip_special_tokens=True)
        rewards = torch.tensor(
            [exact_match(t, batch[i // args.n]["label"]) for i, t in enumerate(texts)]
        )
        completions += len(texts)
        groups = rewards.view(args.prompts, args.n)
        adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
        adv = adv.view(-1)

        model.train()
        logits = model(input_ids=ids, attention_mask=attention).logits[:, width - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok_logp = logp.gather(-1, ids[:, width:].unsqueeze(-1)).squeeze(-1)
        per_sample = (tok_logp * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        loss = -(adv * per_sample).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        if step % args.eval_interval == 0 or step == args.max_steps:
            e0 = time.perf_counter()
            model.eval()
            acc = greedy_accuracy(model, tokenizer, eval_rows)
            eval_seconds += time.perf_counter() - e0
            total = time.perf_counter() - start
            train_s = total - eval_seconds
            curve.append(
                {
                    "step": step,
                    "train_s": round(train_s, 2),
                    "total_s": round(total, 2),
                    "greedy": acc,
                    "reward": round(rewards.mean().item(), 4),
                }
            )
            print(
                f"step {step}: greedy {acc:.1%} | reward {rewards.mean():.3f} | "
                f"train {train_s:.1f}s total {total:.1f}s | "
                f"{completions / train_s:.0f} completions/s",
                flush=True,
            )
            if acc >= args.target or train_s > args.max_seconds:
                break

    cpu = time.process_time() - cpu_start
    passed = next((p for p in curve if p["greedy"] >= 0.85), None)
    when = f"step {passed['step']}, {passed['train_s']:.1f}s of training" if passed else "never"
    print(f"start {curve[0]['greedy']:.1%} -> {curve[-1]['greedy']:.1%}; 85% passed: {when}")
    print(f"process CPU time {cpu:.1f}s, threads {args.threads}")
    if args.save:
        model.save_pretrained(args.save)
        tokenizer.save_pretrained(args.save)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"model": str(args.model)}} | {"curve": curve},
                default=str,
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
