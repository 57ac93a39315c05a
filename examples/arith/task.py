"""The arith task: two-digit addition, written as plain text, scored by exact match.

    prompt  "37+45="          (always 6 characters: both operands are in 10..99)
    label   "82"              (the sum, 20..198: 2 or 3 digits)
    model   "82<|im_end|>"    (the response is the text up to eos; reward = stripped == label)

The 90 * 90 = 8100 problems are split once, by a seeded shuffle, into EVAL_SIZE held-out
problems (eval.jsonl) and the rest (train.jsonl, the RL prompts and the only problems the
starting model's SFT ever sees).

The starting model is made "almost right" on purpose, the way a pretrained model is before RL:
it learned addition from a teacher that is unsure about the carry near the boundary. When the
units digits sum to 5..15 (79% of problems), the teacher writes the carry-flipped answer
(a+b-10 after a carry, a+b+10 without one) with probability CONFUSED_WRONG and the right one
otherwise; everywhere else it is always right. The model learns that mixture: greedy decoding
picks the wrong carry on most confusable problems (greedy accuracy ~ the 21% easy ones plus a
few), while sampling at temperature 1 finds the right answer often (pass@8 near 1). GRPO with
the exact-match reward only has to move the preference between two answers the model already
knows, and then sharpen the carry at the boundary.

Shared by make_data.py, make_model.py, eval_model.py, rl_sanity.py and the unit test; imports
nothing heavy.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL_DIR = HERE / "model"
DATA_DIR = HERE / "data"

OPERANDS = range(10, 100)
SPLIT_SEED = 20240607
EVAL_SIZE = 200
# The teacher's carry confusion: units sums in CONFUSED_UNITS get the carry-flipped answer
# with probability CONFUSED_WRONG.
CONFUSED_UNITS = range(5, 16)
CONFUSED_WRONG = 0.7

Problem = tuple[int, int]


def prompt_of(a: int, b: int) -> str:
    return f"{a}+{b}="


def label_of(a: int, b: int) -> str:
    return str(a + b)


def all_problems() -> list[Problem]:
    return [(a, b) for a in OPERANDS for b in OPERANDS]


def split_problems() -> tuple[list[Problem], list[Problem]]:
    """(train, eval): disjoint, deterministic; eval has EVAL_SIZE problems."""
    problems = all_problems()
    random.Random(SPLIT_SEED).shuffle(problems)
    return problems[EVAL_SIZE:], problems[:EVAL_SIZE]


def confusable(a: int, b: int) -> bool:
    return (a % 10 + b % 10) in CONFUSED_UNITS


def teacher_answers(a: int, b: int, wrong: float = CONFUSED_WRONG) -> list[tuple[str, float]]:
    """The SFT teacher's answer distribution for one problem: [(text, probability)]."""
    right = a + b
    if not confusable(a, b) or wrong <= 0:
        return [(str(right), 1.0)]
    carried = (a % 10 + b % 10) >= 10
    flipped = right - 10 if carried else right + 10
    return [(str(right), 1.0 - wrong), (str(flipped), wrong)]


def exact_match(response: str, label: str) -> float:
    """The reward: millstream's `--rm-type exact` (stripped response == stripped label)."""
    return 1.0 if response.strip() == label.strip() else 0.0


def rows_of(problems: Iterable[Problem]) -> list[dict[str, str]]:
    return [{"prompt": prompt_of(a, b), "label": label_of(a, b)} for a, b in problems]


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(", ", ": ")) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_prompt(prompt: str) -> Problem:
    """ "37+45=" -> (37, 45)."""
    left, right = prompt.rstrip("=").split("+")
    return int(left), int(right)
