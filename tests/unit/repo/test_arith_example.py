"""examples/arith: the shipped model loads offline, its tokenizer round-trips the task's text,
the prompt data parses, train and eval are disjoint, and make_data.py is reproducible."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ARITH = Path(__file__).resolve().parents[3] / "examples" / "arith"
MODEL = ARITH / "model"
DATA = ARITH / "data"


def _load(name: str):
    """Import an examples/arith script by path (the folder is not a package)."""
    before = set(sys.modules)
    sys.path.insert(0, str(ARITH))
    try:
        spec = importlib.util.spec_from_file_location(f"arith_{name}", ARITH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ARITH))
        for sibling in ("task", "eval_model", "make_data", "make_model"):
            if sibling not in before:
                sys.modules.pop(sibling, None)


def _rows(path: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        row = json.loads(line)
        assert set(row) == {"prompt", "label"}, f"{path}:{number}: {row}"
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL, local_files_only=True)


def test_shipped_files_are_small_and_complete():
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        assert (MODEL / name).is_file(), name
    assert (MODEL / "tokenizer.json").is_file() and (MODEL / "tokenizer_config.json").is_file()
    assert (MODEL / "model.safetensors").stat().st_size < 4 * 1024 * 1024


def test_model_loads_offline_and_answers(tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True)
    model.eval()
    assert (
        model.config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    prompts = ["21+12=", "48+39="]  # units sums 3 and 17: far from a carry decision
    ids = tokenizer(prompts, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(
            **ids,
            do_sample=False,
            max_new_tokens=4,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    # The starting model gets the problems that are far from a carry decision right.
    responses = tokenizer.batch_decode(
        out[:, ids["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert responses == ["33", "87"]


def test_tokenizer_round_trips_the_task_text(tokenizer):
    rows = _rows(DATA / "eval.jsonl")[:50]
    for text in [r["prompt"] for r in rows] + [r["prompt"] + r["label"] for r in rows]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text)  # one token per character
        assert tokenizer.decode(ids) == text
    ids = tokenizer("37+45=82", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "37+45=82"
    assert tokenizer.decode(ids) == "37+45=82<|im_end|>"


def test_data_parses_is_correct_and_disjoint():
    train, held_out = _rows(DATA / "train.jsonl"), _rows(DATA / "eval.jsonl")
    assert len(held_out) == 200 and len(train) == 90 * 90 - 200
    for row in train + held_out:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["prompt"].endswith("=") and row["label"] == str(int(a) + int(b))
    train_prompts = {r["prompt"] for r in train}
    eval_prompts = {r["prompt"] for r in held_out}
    assert len(train_prompts) == len(train) and len(eval_prompts) == len(held_out)
    assert not train_prompts & eval_prompts


def test_make_data_is_reproducible(tmp_path):
    make_data = _load("make_data")
    make_data.make_data(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_sft_never_sees_eval_problems():
    task = _load("task")
    train, held_out = task.split_problems()
    assert not set(train) & set(held_out)
    assert [task.prompt_of(a, b) for a, b in held_out] == [
        r["prompt"] for r in _rows(DATA / "eval.jsonl")
    ]
    # The teacher's answers are a distribution, right answer included, on every problem.
    for a, b in train[:500]:
        answers = task.teacher_answers(a, b)
        assert abs(sum(p for _, p in answers) - 1.0) < 1e-9
        assert str(a + b) in [text for text, _ in answers]
