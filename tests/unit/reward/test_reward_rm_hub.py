"""The built-in rewards: a table of (rm_type, response, label, expected reward) per type, plus
answer extraction, normalisation and reward-value parsing."""

from __future__ import annotations

import math

import pytest

from millstream.common.errors import MillstreamError
from millstream.reward.math_utils import (
    extract_answer,
    fast_equiv,
    is_equiv,
    last_boxed,
    last_number,
    normalize,
)
from millstream.reward.rm_hub import rule_reward, split_rm_type, to_reward

THINK = "<think>maybe 7? \\boxed{7}</think>"

TABLE = [
    # math: boxed answer, else the last number; LaTeX normalised; math-verify for the rest
    ("math", "The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("math", "So we get $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),
    ("math", "\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
    ("math", "\\boxed{\\tfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("math", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("math", "Total: 12.0", "12", 1.0),
    ("math", "it costs \\boxed{\\$1,000}", "1000", 1.0),
    ("math", "angle \\boxed{90^\\circ}", "90", 1.0),
    ("math", "\\boxed{\\left(1, 2\\right)}", "(1,2)", 1.0),
    ("math", "\\boxed{x = 5}", "5", 1.0),
    ("math", "first 3, finally 4", "4", 1.0),
    ("math", "\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("math", "\\boxed{3}", "4", 0.0),
    ("math", "\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("math", "no number here", "4", 0.0),
    ("math", "", "4", 0.0),
    ("math", "\\boxed{4}", "\\boxed{4}", 1.0),
    # deepscaler: boxed answer after </think>; no box means 0
    ("deepscaler", "<think>hmm</think> so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("deepscaler", THINK + " final: \\boxed{8}", "7", 0.0),
    ("deepscaler", THINK + " final: \\boxed{7}", "7", 1.0),
    ("deepscaler", "\\boxed{7}", "7", 1.0),
    ("deepscaler", "<think>\\boxed{7}</think> I am not sure", "7", 0.0),
    ("deepscaler", "the answer is 7", "7", 0.0),
    ("deepscaler", "", "7", 0.0),
    # dapo: +1 / -1 from the last "Answer:" line (else the boxed answer)
    ("dapo", "work...\nAnswer: 42", "42", 1.0),
    ("dapo", "Answer: 41\nwait, no.\nAnswer: 42.", "42", 1.0),
    ("dapo", "Answer: 41", "42", -1.0),
    ("dapo", "so \\boxed{42}", "42", 1.0),
    ("dapo", "42", "42", -1.0),
    ("dapo", "", "42", -1.0),
    ("dapo", "answer: \\frac{1}{2}", "0.5", 1.0),
    # f1: token-level F1, SQuAD normalisation (case, punctuation, articles)
    ("f1", "The Eiffel Tower", "eiffel tower", 1.0),
    ("f1", "Eiffel Tower in Paris", "Eiffel Tower", 2 * 0.5 * 1.0 / 1.5),
    ("f1", "Paris", "Eiffel Tower", 0.0),
    ("f1", "yes it is", "yes", 0.0),
    ("f1", "", "Eiffel Tower", 0.0),
    # exact: stripped string equality
    ("exact", "  Paris \n", "Paris", 1.0),
    ("exact", "paris", "Paris", 0.0),
    ("exact", "", "Paris", 0.0),
    # boxed_ prefix: score only the last \boxed{...} (nested braces), "" when there is none
    ("boxed_exact", "so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}", 1.0),
    ("boxed_exact", "\\boxed{1} then \\boxed{2}", "2", 1.0),
    ("boxed_exact", "Paris", "Paris", 0.0),
    ("boxed_f1", "I think \\boxed{Eiffel Tower in Paris}", "Eiffel Tower", 2 * 0.5 * 1.0 / 1.5),
    ("boxed_math", "the last number 5 but \\boxed{4}", "4", 1.0),
    ("boxed_math", "the last number 4", "4", 0.0),
]


@pytest.mark.parametrize(("rm_type", "response", "label", "expected"), TABLE)
def test_builtin_reward_table(rm_type, response, label, expected):
    # millstream's own reading (--rm-compat millstream); Miles' values: test_rm_miles_parity.py
    value = rule_reward(rm_type, response, label, compat="millstream")
    assert value == pytest.approx(expected)


def test_every_builtin_type_is_in_the_table():
    covered = {split_rm_type(row[0])[1] for row in TABLE}
    assert covered == {"math", "deepscaler", "dapo", "f1", "exact"}


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("a \\boxed{{a}{b{c}}} b", "{a}{b{c}}"),
        ("\\boxed{1} and \\fbox{2}", "2"),
        ("\\boxed 5$", "5"),
        ("\\boxed{unclosed", None),
        ("nothing", None),
    ],
)
def test_last_boxed_matches_nested_braces(text, boxed):
    assert last_boxed(text) == boxed


def test_last_number_and_extract_answer():
    assert last_number("we get 1,234 and then -3.5.") == "-3.5"
    assert last_number("x = 3/4") == "3/4"
    assert last_number("none") is None
    assert extract_answer("12 then \\boxed{x}") == "x"
    assert extract_answer("12 then 13") == "13"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{3}{4}", "0.75"),
        ("\\frac12", "1/2"),
        ("2.0", "2"),
        ("2.50", "5/2"),
        ("1,000", "1000"),
        ("-\\frac{1}{2}", "-0.5"),
        (".5", "\\frac{1}{2}"),
        ("10 \\text{ cm}", "10"),
        ("\\text{Paris}", "Paris"),
        ("50\\%", "50"),
    ],
)
def test_fast_path_normalises_without_math_verify(a, b):
    assert fast_equiv(a, b), (normalize(a), normalize(b))


def test_math_verify_settles_what_the_normaliser_cannot():
    assert not fast_equiv("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")
    assert is_equiv("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}")
    assert not is_equiv("\\sqrt{3}", "\\frac{1}{\\sqrt{2}}")
    assert not is_equiv(None, "1") and not is_equiv("1", "") and not is_equiv("}{", "1")


def test_to_reward_reads_numbers_and_dicts():
    assert to_reward(True, None) == 1.0
    assert to_reward(3, None) == 3.0
    assert to_reward({"reward": 0.5}, None) == 0.5
    assert to_reward({"score": -1}, None) == -1.0
    assert to_reward({"acc": 1, "reward": 0}, "acc") == 1.0
    for bad in (None, "1", float("nan"), math.inf, {"acc": 1}, {"reward": "x"}):
        with pytest.raises(ValueError):
            to_reward(bad, None)
    with pytest.raises(ValueError, match="--reward-key 'acc'"):
        to_reward({"reward": 1}, "acc")


def test_unknown_rm_type_names_itself_and_the_choices():
    with pytest.raises(MillstreamError, match=r"'mathh'.*math, deepscaler, dapo, f1, exact"):
        split_rm_type("mathh")
    assert split_rm_type("boxed_remote_rm") == (True, "remote_rm")
