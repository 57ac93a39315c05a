"""Miles' `miles.rollout.rm_hub.deepscaler`: the `deepscaler` and `gemma_math` graders, 1 or 0.

Both grade the last `\\boxed{...}` of the part of the response after the thinking against the
label with math_utils' two tiers (mathd, then sympy); a label holding a `\\boxed{...}` is graded
by what its box holds. An empty label, a response with no box there, or a boxed label whose box
cannot be read scores 0. The label may be a string or a number (read as its text); anything
else raises TypeError (Miles asserts the same).

* deepscaler: the text after the last `</think>`, else the text between the first and second
  `###Response`; a response with neither marker scores 0.
* gemma_math: the text after the last `<channel|>` (how Gemma-4 closes its thinking), else the
  whole response.
"""

from __future__ import annotations

from typing import Any

from .math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy

__all__ = ["get_deepscaler_rule_based_reward", "get_gemma_math_reward"]


def _grade_boxed_solution(model_solution: str, label: Any) -> int:
    answer = extract_answer(model_solution)
    if answer is None or label == "":
        return 0
    if not isinstance(label, str | int | float):
        raise TypeError(f"a math label is a string or a number, got {type(label).__name__}")
    truth: str | None = str(label)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
        if truth is None:
            return 0
    return 1 if grade_answer_mathd(answer, truth) or grade_answer_sympy(answer, truth) else 0


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    if "</think>" in response:
        solution = response.rpartition("</think>")[2]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    return _grade_boxed_solution(solution, label)


def get_gemma_math_reward(response: str, label: Any) -> int:
    return _grade_boxed_solution(response.rpartition("<channel|>")[2], label)
