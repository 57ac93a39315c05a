"""The task bench_vs_peers.py runs every peer on: two-digit addition with a small Llama,
SFT-warm-started to "almost right", built deterministically from a seed and cached.

    prompt "37+45="   label "82"   response "82<|im_end|>"   reward: stripped response == label

`build_task(config, seed, root)` writes (once; rebuilt only when missing or its recipe changed)

    root/<config>-seed<k>/train.jsonl   7900 problems {"prompt", "label"} (the RL prompts)
    root/<config>-seed<k>/eval.jsonl     200 held-out problems (greedy eval)
    root/<config>-seed<k>/model/         tokenizer + LlamaForCausalLM + generation_config.json
    root/<config>-seed<k>/meta.json      recipe, parameter count, SFT seconds, start accuracy

The tokenizer is character-level (0-9, +, = and three special tokens: `<|endoftext|>` pad,
`<|im_start|>`, `<|im_end|>` eos), so the parameters are nearly all in the layers:

    small   hidden 128, 3 layers, MLP 512, 4 heads:  ~0.79M parameters
    medium  hidden 256, 6 layers, MLP 1024, 8 heads: ~6.3M parameters

The warm start is a short SFT on the train problems only (the right answer, then eos; the
loss on the answer), stopped as soon as greedy accuracy on 256 train problems reaches
SFT_TARGET. A tiny model learns this addition in a sudden phase (the carry into the tens digit
comes last); the stop lands in the middle of it, so greedy eval accuracy starts around 30-50%
(small: 31% for seed 0, 39% for seed 1; medium seed 0: 48%, its phase is steeper), sampling
at temperature 1 finds the right answer often, and the slope RL climbs is steep: GRPO with
exact match visibly improves it within a hundred steps at lr 3e-5. One thread, fixed seeds,
deterministic algorithms: the same weights every time on the same torch build. On this
2-core machine with other work beside it the SFT took 40-70 s (small) and ~5 min (medium).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OPERANDS = range(10, 100)
EVAL_SIZE = 200
MAX_NEW_TOKENS = 6
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("0123456789+=")
RECIPE_VERSION = 2
# The SFT stops as soon as greedy accuracy on SFT_CHECK_SIZE train problems reaches SFT_TARGET
# (checked every SFT_CHECK_EVERY steps), or after the config's sft_steps.
SFT_CHECK_SIZE = 256
SFT_CHECK_EVERY = 25
SFT_TARGET = 0.35


@dataclass(frozen=True)
class ModelConfig:
    hidden: int
    layers: int
    heads: int
    mlp: int
    sft_lr: float
    sft_steps: int = 4000  # the cap; the target accuracy usually stops it well before
    sft_batch: int = 32


CONFIGS = {
    "small": ModelConfig(hidden=128, layers=3, heads=4, mlp=512, sft_lr=2e-3),
    "medium": ModelConfig(hidden=256, layers=6, heads=8, mlp=1024, sft_lr=1e-3),
}


@dataclass(frozen=True)
class Task:
    name: str
    seed: int
    model_dir: Path
    train_path: Path
    eval_path: Path
    meta: dict[str, Any]


# -- problems and data ---------------------------------------------------------------------


def split_problems(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, eval): all 90 x 90 problems, shuffled by the seed; eval is EVAL_SIZE of them."""
    problems = [(a, b) for a in OPERANDS for b in OPERANDS]
    random.Random(seed).shuffle(problems)
    return problems[EVAL_SIZE:], problems[:EVAL_SIZE]


def rows_of(problems) -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{b}=", "label": str(a + b)} for a, b in problems]


def exact_match(response: str, label: str) -> float:
    """millstream's `--rm-type exact`."""
    return 1.0 if response.strip() == label.strip() else 0.0


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- tokenizer and model -------------------------------------------------------------------


def build_tokenizer(out: Path):
    """One token per character of CHARS; decode concatenates (no spaces)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tokenizer.save_pretrained(out)
    return tokenizer


def build_model(cfg: ModelConfig, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.mlp,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        max_position_embeddings=32, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, dtype="float32",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    return model, tokenizer


# -- SFT warm start ------------------------------------------------------------------------


def sft_batch(tokenizer, problems: list[tuple[int, int]]):
    """(ids, attention, answer mask): prompt + right answer + eos; the loss is on the answer."""
    import torch

    eos = tokenizer.eos_token_id
    seqs = [
        (tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"], str(a + b))
        for a, b in problems
    ]
    seqs = [
        (p + tokenizer(y, add_special_tokens=False)["input_ids"] + [eos], len(p)) for p, y in seqs
    ]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (toks, start) in enumerate(seqs):
        ids[i, : len(toks)] = torch.tensor(toks)
        attn[i, : len(toks)] = 1
        mask[i, start : len(toks)] = 1.0
    return ids, attn, mask


def sft(model, tokenizer, problems, cfg: ModelConfig, seed: int, log=print) -> int:
    """Cross-entropy on the answer tokens (and eos), AdamW at a constant lr after a warmup,
    until greedy accuracy on the first SFT_CHECK_SIZE train problems reaches SFT_TARGET.
    Returns the steps taken."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.98), weight_decay=0)
    check = rows_of(problems[:SFT_CHECK_SIZE])
    order: list[tuple[int, int]] = []
    model.train()
    for step in range(1, cfg.sft_steps + 1):
        if len(order) < cfg.sft_batch:
            order += rng.sample(problems, len(problems))
        picked, order = order[: cfg.sft_batch], order[cfg.sft_batch :]
        ids, attn, mask = sft_batch(tokenizer, picked)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1], -1)
        nll = -(logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]).sum()
        for group in opt.param_groups:
            group["lr"] = cfg.sft_lr * min(1.0, step / 50)
        opt.zero_grad(set_to_none=True)
        (nll / cfg.sft_batch).backward()
        opt.step()
        if step % SFT_CHECK_EVERY == 0:
            accuracy = greedy_accuracy(model, tokenizer, check)
            if step % (8 * SFT_CHECK_EVERY) == 0 or accuracy >= SFT_TARGET:
                log(
                    f"  sft step {step}: greedy accuracy on {len(check)} train problems {accuracy:.1%}"
                )
            if accuracy >= SFT_TARGET:
                break
    model.eval()
    return step


# -- eval ----------------------------------------------------------------------------------


def generate(model, tokenizer, prompts: list[str], *, sample: bool, max_new_tokens: int):
    """(ids [B, P+R], prompt width P) with HF generate; greedy or full-vocabulary T=1."""
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    enc = enc.to(model.device)  # the bench's --device cuda runs the model on the GPU
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with torch.no_grad():  # not inference_mode: the rollout's ids go into a backward
        ids = model.generate(
            **enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, **(sampling if sample else {"do_sample": False}),
        )  # fmt: skip
    return ids, enc["input_ids"].shape[1]


def greedy_accuracy(model, tokenizer, rows: list[dict]) -> float:
    was_training = model.training
    model.eval()
    ids, width = generate(
        model, tokenizer, [r["prompt"] for r in rows], sample=False, max_new_tokens=MAX_NEW_TOKENS
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(ids[:, width:], skip_special_tokens=True)
    return sum(exact_match(t, r["label"]) for t, r in zip(texts, rows, strict=True)) / len(rows)


# -- the cached task -----------------------------------------------------------------------


def recipe(name: str, seed: int) -> dict[str, Any]:
    return {
        "version": RECIPE_VERSION, "config": name, "seed": seed, **asdict(CONFIGS[name]),
        "sft_target": SFT_TARGET, "sft_check_size": SFT_CHECK_SIZE, "sft_check_every": SFT_CHECK_EVERY,
    }  # fmt: skip


def build_task(name: str, seed: int, root: Path, log=print) -> Task:
    """The task for (config, seed), built into root/<name>-seed<seed>/ unless already there."""
    out = Path(root) / f"{name}-seed{seed}"
    meta_path = out / "meta.json"
    want = recipe(name, seed)
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("recipe") == want and (out / "model" / "config.json").exists():
            return _task(name, seed, out, meta)
    log(f"building task {out.name} (deterministic SFT warm start, one thread) ...")
    meta = _build(name, seed, out, want, log)
    log(
        f"built {out.name}: {meta['params']:,} parameters, SFT {meta['sft_steps']} steps "
        f"in {meta['sft_seconds']:.0f}s, "
        f"greedy eval accuracy {meta['start_accuracy']:.1%}"
    )
    return _task(name, seed, out, meta)


def _task(name: str, seed: int, out: Path, meta: dict) -> Task:
    return Task(name, seed, out / "model", out / "train.jsonl", out / "eval.jsonl", meta)


def _build(name: str, seed: int, out: Path, want: dict, log) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    cfg = CONFIGS[name]
    train, held_out = split_problems(seed)
    write_jsonl(out / "train.jsonl", rows_of(train))
    write_jsonl(out / "eval.jsonl", rows_of(held_out))
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(seed)
        model_dir = out / "model"
        tokenizer = build_tokenizer(model_dir)
        model = build_model(cfg, tokenizer)
        start = time.perf_counter()
        steps = sft(model, tokenizer, train, cfg, seed, log)
        took = time.perf_counter() - start
        model.save_pretrained(model_dir, safe_serialization=True)
        GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
        ).save_pretrained(model_dir)  # fmt: skip
        accuracy = greedy_accuracy(model, tokenizer, rows_of(held_out))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    meta = {
        "recipe": want, "params": sum(p.numel() for p in model.parameters()),
        "sft_steps": steps, "sft_seconds": round(took, 1), "start_accuracy": accuracy,
    }  # fmt: skip
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta
