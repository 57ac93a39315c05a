"""Recreate the shipped arith starting model in examples/arith/model/ (deterministic, offline).

    .venv/bin/python examples/arith/make_model.py [--out DIR]

1. Tokenizer: byte-level BPE with the 256 byte symbols and no merges (one token per character,
   any text round-trips), plus `<|endoftext|>` (pad), `<|im_start|>` and `<|im_end|>` (eos).
2. Model: a 2-layer Qwen2 (hidden 64, 4 heads, 2 KV heads, tied embeddings), ~91k parameters.
3. SFT on the train problems only (never eval.jsonl's): a weighted cross-entropy on the answer
   tokens and eos against the carry-confused teacher of task.py (the right answer and, on the
   confusable problems, the carry-flipped one, each weighted by its teacher probability).
   Single thread, fixed seeds, deterministic algorithms: the same weights on every run with
   the same torch build.
4. Print greedy accuracy and pass@8 (T=1) on eval.jsonl's problems.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from task import (
    CONFUSED_WRONG,
    MODEL_DIR,
    prompt_of,
    split_problems,
    teacher_answers,
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


def sft_examples(tokenizer, problems, wrong: float):
    """[(token ids, index where the answer starts, weight)] for every teacher answer."""
    eos = tokenizer.eos_token_id
    out = []
    for a, b in problems:
        prompt = tokenizer(prompt_of(a, b), add_special_tokens=False)["input_ids"]
        group = []
        for text, weight in teacher_answers(a, b, wrong):
            answer = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            group.append((prompt + answer, len(prompt), weight))
        out.append(group)
    return out


def collate(groups, pad_id: int):
    import torch

    seqs = [s for g in groups for s in g]
    width = max(len(ids) for ids, _, _ in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)  # 1 on answer tokens + eos
    weight = torch.tensor([w for _, _, w in seqs], dtype=torch.float32)
    for i, (toks, start, _) in enumerate(seqs):
        ids[i, : len(toks)] = torch.tensor(toks)
        attn[i, : len(toks)] = 1
        mask[i, start : len(toks)] = 1.0
    return ids, attn, mask, weight


def train(model, tokenizer, problems, *, wrong, steps, batch_size, lr, warmup, seed, log_every):
    """Weighted-mixture SFT; returns seconds spent."""
    import torch

    data = sft_examples(tokenizer, problems, wrong)
    rng = random.Random(seed)
    order: list[int] = []
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    start = time.perf_counter()
    for step in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(data)))
            rng.shuffle(fresh)
            order.extend(fresh)
        picked, order = order[:batch_size], order[batch_size:]
        ids, attn, mask, weight = collate([data[i] for i in picked], tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok_logp = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        nll = -(tok_logp * mask[:, 1:]).sum(dim=1)  # per sequence
        loss = (weight * nll).sum() / batch_size  # expected NLL per problem
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (step + 1) % log_every == 0:
            took = time.perf_counter() - start
            print(f"  sft step {step + 1}/{steps} loss {loss.item():.4f} ({took:.0f}s)", flush=True)
    model.eval()
    return time.perf_counter() - start


def make_model(
    out: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    mlp_mult: int = 4,
    wrong: float = CONFUSED_WRONG,
    steps: int = 1500,
    batch_size: int = 128,
    lr: float = 3e-3,
    warmup: int = 50,
    seed: int = 0,
    log_every: int = 100,
) -> Path:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    random.seed(seed)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * mlp_mult,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Qwen2 hidden={hidden} layers={layers} heads={heads}/{kv_heads} "
        f"vocab={len(tokenizer)} params={n_params}"
    )

    train_problems, _ = split_problems()
    took = train(
        model,
        tokenizer,
        train_problems,
        wrong=wrong,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        warmup=warmup,
        seed=seed,
        log_every=log_every,
    )
    print(f"sft: {steps} steps x {batch_size} problems in {took:.1f}s")
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=8,
    ).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--mlp-mult", type=int, default=4)
    parser.add_argument(
        "--confused-wrong",
        type=float,
        default=CONFUSED_WRONG,
        help="teacher's probability of the carry-flipped answer on confusable problems",
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-eval", action="store_true")
    args = parser.parse_args(argv)

    out = make_model(
        args.out,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        mlp_mult=args.mlp_mult,
        wrong=args.confused_wrong,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} (model.safetensors {size} bytes)")
    if args.no_eval:
        return
    from eval_model import evaluate, load
    from task import rows_of

    model, tokenizer = load(out)
    _, held_out = split_problems()
    res = evaluate(model, tokenizer, rows_of(held_out), k=8, temperature=1.0, seed=0)
    print(
        f"eval ({len(held_out)} held-out problems): greedy {res['greedy']:.1%} | "
        f"pass@8 {res['pass@8']:.1%} (T=1) | sample {res['sample']:.1%}"
    )


if __name__ == "__main__":
    main()
