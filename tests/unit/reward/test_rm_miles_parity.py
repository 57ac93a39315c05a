"""Every built-in --rm-type gives Miles' value for the same (response, label, metadata) (issue 14).

Each expected value below was derived by reading Miles' code, radixark/miles @ 31f1ca96,
miles/rollout/rm_hub/ (the comment names the file and function), and cross-checked by running
those files out of tree. Rows run through the real reward path: `Rewarder.sample_reward` on a
wire Sample, with `--rm-type` and the row's metadata (`{"rm_type": ...}` wins, as in Miles'
`_resolve_reward_config`). MS is what `--rm-compat millstream` gives where it differs on purpose.

`exact` has no Miles counterpart: its rows check the response "as the model produced it" (tokens
decoded with special tokens kept, the stop token dropped) and that a response cut by the length
limit scores 0, with the arith example's real tokenizer.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from millstream.common.config import parse_run_config
from millstream.common.types import Sample
from millstream.reward.math_utils import fast_equiv, is_equiv, math_verify_equiv
from millstream.reward.rewarder import Rewarder
from millstream.reward.rm_hub import rule_reward, to_reward

ARITH_MODEL = Path(__file__).resolve().parents[3] / "examples" / "arith" / "model"
F1_HALF = 2 * 0.5 * 1.0 / 1.5  # precision 1/2, recall 1

# (rm_type, response, label, metadata, Miles' value, millstream's value or None when the same)
# G = math_utils.py grade_answer_verl, DS = deepscaler.py get_deepscaler_rule_based_reward,
# DAPO = math_dapo_utils.py compute_score["score"], F1 = f1.py f1_score[0],
# BOX = __init__.py async_rm (`boxed_` prefix: math_utils.extract_answer(response) or "").
TABLE = [
    # --- math (G): the last \boxed{} only; mathd normalisation, then the sympy tier
    ("math", "The answer is \\boxed{\\frac{1}{2}}.", "0.5", None, 1, None),  # G: mathd 0.5->frac
    ("math", "Total: 12", "12", None, 0, 1),  # G: extract_answer None (no box) -> False
    ("math", "\\boxed{1} then \\boxed{2}", "2", None, 1, None),  # G: last_boxed_only_string
    ("math", "\\boxed{1} then \\boxed{2}", "1", None, 0, None),  # G: several boxes, last wins
    ("math", "\\boxed{10\\text{ cm}}", "10\\text{ m}", None, 1, None),  # G: _remove_right_units
    ("math", "\\boxed{50\\%}", "50", None, 1, None),  # G: _strip_string drops \\%
    ("math", "\\boxed{1,000}", "1000", None, 1, None),  # G: sympy tier _str_is_int strips commas
    ("math", "\\boxed{x = 5}", "5", None, 1, None),  # G: _strip_string drops a short "x ="
    ("math", "\\boxed{3.0}", "3", None, 1, None),  # G: sympy tier _normalize 3.0 -> 3
    ("math", "Answer: 5", "5", None, 0, 1),  # G: no box -> False
    ("math", "\\fbox{5}", "5", None, 0, 1),  # G: extract_answer needs "\\boxed" in the text
    ("math", "\\boxed{5}", "\\boxed{5}", None, 1, None),  # G: a boxed label is extracted
    ("math", "\\boxed{4}", "5", None, 0, None),  # G: mathd and sympy both differ
    ("math", "\\boxed{5}", "", None, 0, None),  # G: `if not ground_truth: return False`
    # --- deepscaler (DS): the box after the last </think>, or after the first ###Response
    ("deepscaler", "<think>hmm</think> so \\boxed{\\frac{1}{2}}", "0.5", None, 1, None),
    ("deepscaler", "\\boxed{7}", "7", None, 0, 1),  # DS: no </think>, no ###Response -> 0
    ("deepscaler", "<think>\\boxed{7}</think> not sure", "7", None, 0, None),  # DS: no box after
    ("deepscaler", "<think>a</think>b</think> \\boxed{7}", "7", None, 1, None),  # DS: split[-1]
    ("deepscaler", "###Response \\boxed{7} ###Response \\boxed{8}", "7", None, 1, 0),  # split[1]
    ("deepscaler", "</think>\\boxed{7}", "", None, 0, None),  # DS: `if label == "": return 0`
    # --- dapo (DAPO): the last "Answer:" in the last 300 chars, Minerva-normalised, == int label
    ("dapo", "work...\nAnswer: 42", "42", None, 1.0, None),  # DAPO: is_correct_minerva
    ("dapo", "Answer: 41\nwait.\nAnswer: 42", "42", None, 1.0, None),  # DAPO: match[-1]
    ("dapo", "Answer: 41\nwait.\nAnswer: 42.", "42", None, -1.0, 1.0),  # DAPO: "42." kept
    ("dapo", "so \\boxed{42}", "42", None, -1.0, 1.0),  # DAPO: no Answer: -> "[INVALID]"
    ("dapo", "The answer: 42", "42", None, 1.0, None),  # DAPO: (?i)Answer\s*:
    ("dapo", "Answer: 1,000", "1000", None, 1.0, None),  # DAPO: digits after removing ","
    ("dapo", "Answer: 50\\%", "50", None, -1.0, 1.0),  # DAPO: "\\%" is not removed
    ("dapo", "Answer: 10 cm", "10", None, 1.0, None),  # DAPO: REMOVED_EXPRESSIONS "cm"
    ("dapo", "Answer: x = 5", "5", None, 1.0, None),  # DAPO: split("=")[-1]
    ("dapo", "Answer: 42<|im_end|>", "42", None, 1.0, None),  # DAPO: "<|im_end|>" removed
    ("dapo", "Answer: 0", "0.5", None, 1.0, -1.0),  # DAPO: gt = str(int(float(gt))) -> "0"
    ("dapo", "Answer: 42\n" + "x" * 300, "42", None, -1.0, None),  # DAPO: solution_str[-300:]
    # --- f1 (F1): SQuAD normalisation, yes/no/noanswer all or nothing
    ("f1", "The Eiffel Tower", "eiffel tower", None, 1.0, None),
    ("f1", "Eiffel Tower in Paris", "Eiffel Tower", None, F1_HALF, None),
    ("f1", "yes it is", "yes", None, 0.0, None),  # F1: gold "yes" != prediction -> 0
    ("f1", "No.", "no", None, 1.0, None),
    ("f1", "", "Eiffel Tower", None, 0.0, None),
    # --- further edge cases of G / DS / DAPO (expected values from Miles' code at 31f1ca96)
    ("math", "\\boxed{\\dfrac{3}{4}}", "0.75", None, 1, None),  # G: sympy tier via pylatexenc
    ("math", "\\boxed{(1, 2)}", "[1, 2)", None, 0, None),  # G: interval brackets must agree
    ("math", "\\boxed{(1, 2)}", "(1,2)", None, 1, None),  # G: tuple elements compared
    ("math", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", None, 0, 1),  # G: fractions not reduced
    ("math", "\\boxed{7 3/4}", "7\\frac{3}{4}", None, 1, 0),  # G: mixed number 7 3/4 = 7+3/4
    ("math", "\\boxed{2 million}", "2000000", None, 0, None),  # G: integer label, non-int answer
    ("math", "\\boxed {5}", "5", None, 0, 1),  # G: remove_boxed needs "\\boxed{"
    ("math", "\\boxed{\\sqrt2}", "\\sqrt{2}", None, 1, None),  # G: _fix_sqrt
    ("math", "\\boxed{0.99999999}", "1", None, 1, 0),  # G: whole within 1e-7
    ("math", "\\boxed{x^2+2x+1}", "(x+1)^2", None, 1, None),  # G: sympy.simplify of the difference
    ("math", "\\boxed{\\text{Paris}}", "paris", None, 1, None),  # G: \\text{} unwrapped, lower case
    ("math", "\\boxed{-\\frac{1}{2}}", "- 1/2", None, 1, None),  # G: "- " closed up
    ("math", "\\boxed{1.5}", "3/2", None, 1, None),
    ("math", "\\boxed{\\$1,234.50}", "1234.5", None, 1, None),  # G: currency, thousands comma
    ("math", "\\boxed{30^\\circ}", "30 degrees", None, 1, None),  # G: degree words and marks
    ("math", "\\boxed{10\\text{ cm}\\text{ m}}", "10", None, 0, 1),  # G: two unit texts: as is
    ("math", "\\boxed{\\frac5}", "5", None, 0, None),  # G: \\frac with one character after
    ("math", "\\boxed{5", "5", None, 0, 1),  # G: an unclosed box is no answer
    ("deepscaler", "###Response \\boxed{7}", "\\boxed{7}", None, 1, None),  # DS: boxed label
    ("dapo", "Answer: $\\frac{84}{2}$", "42", None, -1.0, 1.0),  # DAPO: strings, no arithmetic
    ("dapo", "Answer: 42 points", "42", None, 1.0, -1.0),  # DAPO: "points" removed
    ("dapo", "Answer: 7", "7.9", None, 1.0, -1.0),  # DAPO: the label's integer part
    ("dapo", "Answer: \\boxed{42}", "42", None, 1.0, None),  # DAPO: \\boxed{} unwrapped
    ("dapo", "Answer: x = 1,000", "1000", None, 1.0, -1.0),  # DAPO: after "=", commas dropped
    # --- boxed_ prefix (BOX)
    ("boxed_f1", "I think \\boxed{Eiffel Tower in Paris}", "Eiffel Tower", None, F1_HALF, None),
    ("boxed_math", "so \\boxed{4}", "4", None, 0, 1),  # BOX then G: "4" has no \\boxed -> 0
    ("boxed_math", "\\fbox{4}", "4", None, 0, 1),  # BOX: extract_answer(\\fbox) None -> ""
    ("boxed_f1", "no box", "Paris", None, 0.0, None),  # BOX: "" then F1 0
    # --- metadata rm_type wins over --rm-type (__init__.py _resolve_reward_config)
    ("math", "Eiffel Tower in Paris", "Eiffel Tower", {"rm_type": "f1"}, F1_HALF, None),
    ("f1", "\\boxed{2}", "2", {"rm_type": "math", "x": 1}, 1, None),
    ("f1", "no box", "2", {"other": 1}, 0.0, None),  # no rm_type in metadata: --rm-type
]


def make_cfg(*flags: str):
    return parse_run_config(["--run-id", "t", "--rollout-batch-size", "1", *flags], mode="async")


def reward_of(cfg, sample: Sample) -> float:
    return asyncio.run(Rewarder(cfg).sample_reward(sample, ""))


def wire(response: str, label: str, metadata=None, **fields) -> Sample:
    meta = json.dumps(metadata) if metadata is not None else ""
    fields.setdefault("finish_reason", "stop")
    return Sample(group_id="g", response_text=response, label=label, metadata_json=meta, **fields)


@pytest.mark.parametrize(("rm_type", "response", "label", "metadata", "miles", "ours"), TABLE)
def test_builtin_gives_miles_value(rm_type, response, label, metadata, miles, ours):
    sample = wire(response, label, metadata)
    assert reward_of(make_cfg("--rm-type", rm_type), sample) == pytest.approx(miles)
    expected = miles if ours is None else ours
    millstream = make_cfg("--rm-type", rm_type, "--rm-compat", "millstream")
    assert reward_of(millstream, sample) == pytest.approx(expected)


def test_dapo_needs_an_integer_label_as_in_miles():
    # DAPO: `gt = str(int(float(gt)))` raises on "\\frac{1}{2}": Miles fails the sample too.
    with pytest.raises(ValueError, match="integer label"):
        rule_reward("dapo", "Answer: \\frac{1}{2}", "\\frac{1}{2}")
    assert to_reward(rule_reward("dapo", "Answer: 1/2", "1/2", compat="millstream"), None) == 1.0


def test_units_are_not_a_millstream_equality_math_verify_lacks():
    # Miles' grade_answer_verl says 10 cm == 10 m (both lose "\\text{ ...}"); so does math-verify
    # (checked here, so the day it changes its mind this test says so).
    assert math_verify_equiv("10\\text{ cm}", "10\\text{ m}")
    assert is_equiv("10\\text{ cm}", "10\\text{ m}")


# Pairs the hand-written normaliser finds equal: is_equiv must say "equal" only where
# math-verify does too (the first two the normaliser alone equated and math-verify does not).
NORMALISED_EQUAL = [
    ("x=5", "y=5"),
    ("3 \\, 000", "3000"),
    ("10\\text{ cm}", "10\\text{ m}"),
    ("50\\%", "50"),
    ("1,000", "1000"),
    ("x=5", "5"),
    ("\\$5", "5"),
    ("30^\\circ", "30"),
    ("0.5", "\\frac12"),
    ("\\frac{2}{4}", "\\frac{1}{2}"),
    ("2.0", "2"),
    ("{5}", "5"),
]


@pytest.mark.parametrize(("a", "b"), NORMALISED_EQUAL)
def test_is_equiv_never_equal_where_math_verify_says_not(a, b):
    assert fast_equiv(a, b)
    assert is_equiv(a, b) == math_verify_equiv(a, b)


# --- exact: the response as produced, finish reason seen -------------------------------------


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ARITH_MODEL)


def produced(tok, pieces: list[str], finish: str, *, skip: bool) -> Sample:
    """A wire sample as the rollout builds it: token ids plus the engine's text for them."""
    ids = [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]]
    text = tok.decode(ids, skip_special_tokens=skip)
    return wire(text, "82", response_token_ids=ids, finish_reason=finish)


EOS, PAD = "<|im_end|>", "<|endoftext|>"
EXACT = [
    # pieces, finish_reason, reward (with and without --rollout-skip-special-tokens)
    (["82", EOS], "stop", 1.0),  # stopped by EOS: right, whether the EOS is in the text or not
    (["81", EOS], "stop", 0.0),
    (["82", PAD, PAD], "length", 0.0),  # cut by the length limit: no EOS, no answer
    (["82"], "length", 0.0),
    (["82", PAD], "length", 0.0),  # a pad is no stop token
    (["82", EOS], "length", 1.0),  # EOS was the last token allowed: SGLang says "length"
    (["8", PAD, "2", EOS], "stop", 0.0),  # a special token inside the answer: not "82"
    ([" 82 ", EOS], "stop", 1.0),  # stripped, as before
]


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize(("pieces", "finish", "reward"), EXACT)
def test_exact_sees_tokens_and_finish_reason(tok, pieces, finish, reward, skip):
    flags = ["--rm-type", "exact", "--hf-checkpoint", str(ARITH_MODEL)]
    if skip:
        flags.append("--rollout-skip-special-tokens")
    assert reward_of(make_cfg(*flags), produced(tok, pieces, finish, skip=skip)) == reward


def test_exact_drops_a_stop_string_and_reads_text_without_a_tokenizer(tok):
    cfg = make_cfg("--rm-type", "exact", "--hf-checkpoint", str(ARITH_MODEL), "--rollout-stop", "=")
    assert reward_of(cfg, produced(tok, ["82="], "stop", skip=False)) == 1.0
    # No --hf-checkpoint: the text, still 0 when cut by length.
    bare = make_cfg("--rm-type", "exact")
    assert reward_of(bare, wire("82", "82")) == 1.0
    assert reward_of(bare, wire("82", "82", finish_reason="length")) == 0.0
    assert reward_of(bare, wire("82", "82", finish_reason="abort")) == 0.0
