"""Miles' `miles.rollout.rm_hub.math_dapo_utils`: the `dapo` grader, `compute_score`.

`compute_score(solution_str, ground_truth)` reads only the last 300 characters of the
solution: its last `Answer: ...` line (none: "[INVALID]") and the ground truth both go through
`normalize_final_answer` (Minerva's normal form), and the ground truth must then read as a
number, whose integer part, as a string, is what the answer has to equal (a ground truth that
is no number raises ValueError, as in Miles). The result is Miles' dict: {"score": 1.0 or -1.0,
"acc": bool, "pred": the normal form read}. With `strict_box_verify` the last `\\boxed{...}`
within the final 100 characters must equal the ground truth as given.

Behaviour matches Miles' rm_hub at commit 31f1ca96 (tests/unit/reward/test_rm_miles_parity.py).
Miles' signal-based `timeout` helper is not here: a signal alarm works only on the main thread,
and the reward service bounds every reward with --reward-timeout instead.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "REMOVED_EXPRESSIONS",
    "SUBSTITUTIONS",
    "compute_score",
    "is_correct_minerva",
    "is_correct_strict_box",
    "last_boxed_only_string",
    "normalize_final_answer",
    "remove_boxed",
    "verify",
]

_WINDOW = 300  # only the end of the solution is read; MATH-500's longest answer is 159 chars
_STRICT_WINDOW = 100
_ANSWER_LINE = r"(?i)Answer\s*:\s*([^\n]+)"
_NO_ANSWER = "[INVALID]"
_BOX_OPEN = "\\boxed{"

# Applied in order, as plain string replacements: articles and spaces go, `mbox` reads as
# `text`, `and` in a text becomes a comma, a metre text empties.
SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]  # fmt: skip
# Then deleted, in order: unit and counting words, ellipses, empty or unit texts, ordinal
# and degree marks, thin spaces and `,\!` separators, quotes and chat end tokens.
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
]  # fmt: skip
# Then these rewrites, in order: keep only the first `$...$` span; unwrap `\text{}`,
# `\textbf{}`, `\overline{}` (to the first `}`) and `\boxed{}` (to the last); brace one-character
# `frac` and `sqrt` arguments.
_REWRITES = (
    (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),
    (r"(\\text\{)(.*?)(\})", r"\2"),
    (r"(\\textbf\{)(.*?)(\})", r"\2"),
    (r"(\\overline\{)(.*?)(\})", r"\2"),
    (r"(\\boxed\{)(.*)(\})", r"\2"),
    (r"(frac)([^{])(.)", r"frac{\2}{\3}"),
    (r"(sqrt)([^{])", r"sqrt{\2}"),
)


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{` through its closing brace, or None (none, or never closed). Unlike
    math_utils' namesake, an `\\fbox` is not looked for."""
    start = string.rfind(_BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(string)):
        if string[i] == "{":
            depth += 1
        elif string[i] == "}":
            depth -= 1
            if depth == 0:
                return string[start : i + 1]
    return None


def remove_boxed(s: str) -> str:
    """The inside of `\\boxed{...}`; ValueError naming `s` for anything else."""
    if not (s.startswith(_BOX_OPEN) and s.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}}: {s!r}")
    return s[len(_BOX_OPEN) : -1]


def normalize_final_answer(final_answer: Any) -> str:
    """Minerva's normal form: only the right-hand side of the last `=`, then the tables above,
    then `$` dropped; digits with commas lose the commas; outer space stripped."""
    s = str(final_answer).split("=")[-1]
    for old, new in SUBSTITUTIONS:
        s = s.replace(old, new)
    for piece in REMOVED_EXPRESSIONS:
        s = s.replace(piece, "")
    for pattern, replacement in _REWRITES:
        s = re.sub(pattern, replacement, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def is_correct_minerva(
    solution_str: str, gt: Any, gt_need_extract: bool = False, answer_pattern: str = _ANSWER_LINE
) -> tuple[bool, str]:
    """(right?, the answer's normal form): the last `answer_pattern` match against the ground
    truth's integer part (`gt_need_extract`: the ground truth's last box first)."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else _NO_ANSWER)
    if gt_need_extract:
        boxed = last_boxed_only_string(gt)
        if boxed is None:
            raise ValueError(f"the ground truth has no \\boxed{{...}}: {gt!r}")
        gt = remove_boxed(boxed)
    want = str(int(float(normalize_final_answer(gt))))  # in dapo every answer is an integer
    return pred == want, pred


def is_correct_strict_box(
    pred: str, gt: str, pause_tokens_index: list[int] | None = None
) -> tuple[int, str | None]:
    """(1 or -1, the boxed answer read): the last box near the end must equal `gt` as given.
    `pause_tokens_index` (four positions) moves the window to 100 characters before the last."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index needs 4 positions, got {pause_tokens_index!r}")
        pred = pred[pause_tokens_index[-1] - _STRICT_WINDOW :]
    else:
        pred = pred[-_STRICT_WINDOW:]
    boxed = last_boxed_only_string(pred)
    answer = remove_boxed(boxed) if boxed is not None else None
    return (1 if answer == gt else -1), answer


def verify(
    solution_str: str,
    answer: Any,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> tuple[bool, str | None]:
    """(right?, what was read), by the strict box or by Minerva's rule."""
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(
    solution_str: str,
    ground_truth: Any,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """Miles' `dapo` reward (see the module docstring)."""
    right, pred = verify(
        solution_str[-_WINDOW:], ground_truth, strict_box_verify, pause_tokens_index
    )
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}
