"""Miles' `miles.rollout.rm_hub.math_utils`: the `math` grader, `grade_answer_verl`.

`grade_answer_verl(solution_str, ground_truth)` is True when the contents of the last
`\\boxed{...}` of the solution (no box: False) match the ground truth, itself unboxed when it
holds a `\\boxed{...}` (an empty or falsy ground truth: False; a number is read as its text).
A match is either of two tiers:

1. mathd (`grade_answer_mathd`): both sides are rewritten into one canonical LaTeX spelling
   (`mathd_normalize_answer`, the steps in `_MATHD_STEPS`) and compared as strings.
2. sympy (`grade_answer_sympy`): both sides are rewritten into something sympy can parse
   (units, currency and LaTeX dropped), split into tuple or interval elements when the ground
   truth is one, and compared element by element: unreduced fractions and integers only as
   strings, anything else by `sympy.simplify(truth - answer) == 0`.

`extract_answer(passage)` is what the `boxed_` prefix of an rm_type reads: the last
`\\boxed{...}`'s contents, None without one (an `\\fbox` alone, `\\boxed 5`, an unclosed box).

Behaviour matches Miles' rm_hub at commit 31f1ca96 (tests/unit/reward/test_rm_miles_parity.py checks
it through the reward service, which calls these very functions). Unlike Miles' module, this
one imports neither sympy nor pylatexenc until the sympy tier first needs them. Without
pylatexenc (the `reward` extra) LaTeX stays as written in the sympy tier, so e.g.
`\\dfrac{3}{4}` against `0.75` is no match where Miles finds one; a warning says so.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "are_equal_under_sympy",
    "extract_answer",
    "extract_boxed_answer",
    "grade_answer_mathd",
    "grade_answer_sympy",
    "grade_answer_verl",
    "last_boxed_only_string",
    "mathd_normalize_answer",
    "remove_boxed",
    "should_allow_eval",
    "split_tuple",
]

log = logging.getLogger(__name__)


# --- finding the answer -----------------------------------------------------------------------

_BOX = "\\boxed"


def _closing_brace(text: str, start: int) -> int | None:
    """Where the brace depth, counted from `start`, first falls back to zero at a `}`; None
    when it never does (a `}` before any `{` only takes the depth below zero)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed` (without one, the last `\\fbox`) through the brace that closes
    the first brace after it, command included; None when there is neither or it never closes."""
    start = string.rfind(_BOX)
    if start < 0:
        start = string.rfind("\\fbox")
    if start < 0:
        return None
    end = _closing_brace(string, start)
    return None if end is None else string[start : end + 1]


def remove_boxed(s: str | None) -> str | None:
    """The inside of `\\boxed{...}`; None for anything else (an `\\fbox{...}`, `\\boxed 5`)."""
    left = _BOX + "{"
    if s is None or not s.startswith(left) or not s.endswith("}"):
        return None
    return s[len(left) : -1]


def extract_boxed_answer(solution: str) -> str | None:
    """What the last `\\boxed{...}` of `solution` holds, or None."""
    return remove_boxed(last_boxed_only_string(solution))


def extract_answer(passage: str) -> str | None:
    """The answer a `\\boxed{...}` gives; None when the passage has no `\\boxed` at all."""
    return extract_boxed_answer(passage) if _BOX in passage else None


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Miles' `math` reward as a bool (see the module docstring)."""
    if not ground_truth:
        return False
    truth: str | None = str(ground_truth)
    if _BOX in truth:
        truth = extract_answer(truth)
    given = extract_answer(solution_str)
    if given is None:
        return False
    return grade_answer_mathd(given, truth) or grade_answer_sympy(given, truth)


def grade_answer_mathd(given_answer: str, ground_truth: str | None) -> bool:
    """Tier 1: the same canonical LaTeX spelling."""
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)


# --- tier 1: one canonical LaTeX spelling, compared as strings --------------------------------


class _Malformed(Exception):
    """A step met LaTeX it cannot rewrite (`\\sqrt` or `\\frac` with no argument, two unit
    texts): the answer is then compared as it was before any step."""


def _text_body(s: str) -> str | None:
    """The inside of an answer that is one `\\text{...}` from end to end, or None."""
    found = re.fullmatch(r"\\text\{(.+)\}\n?", s)
    return found.group(1) if found else None


def _delete(*pieces: str) -> Callable[[str], str]:
    def step(s: str) -> str:
        for piece in pieces:
            s = s.replace(piece, "")
        return s

    return step


def _unify_fractions(s: str) -> str:
    # Only the command's tail is matched, so `\tfrac`, `\dfrac` (and a bare `dfrac`) all
    # become `frac`.
    return s.replace("tfrac", "frac").replace("dfrac", "frac")


def _drop_unit_text(s: str) -> str:
    """`10\\text{ cm}`: a `\\text{` followed by a space names a unit; keep what precedes it.
    More than one such text is malformed."""
    parts = s.split("\\text{ ")
    if len(parts) > 2:
        raise _Malformed
    return parts[0]


def _lead_zero_on_decimals(s: str) -> str:
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    return "0" + s if s.startswith(".") else s


def _drop_short_lhs(s: str) -> str:
    """`x = 5` -> ` 5`: one `=` whose left side is at most two characters is a name."""
    sides = s.split("=")
    return sides[1] if len(sides) == 2 and len(sides[0]) <= 2 else s


def _brace_sqrt_argument(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}`: an unbraced argument is the one character that follows."""
    if s.endswith("\\sqrt") or "\\sqrt\\sqrt" in s:
        raise _Malformed
    return re.sub(r"\\sqrt([^{])", r"\\sqrt{\1}", s)


def _brace_frac_arguments(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`: unbraced arguments are
    single characters. A `\\frac` followed by one character leaves the whole answer as it is;
    one followed by nothing is malformed."""
    head, *tails = s.split("\\frac")
    rewritten = [head]
    for tail in tails:
        if not tail:
            raise _Malformed
        if tail[0] != "{":
            if len(tail) < 2:
                return s
            first, second, rest = tail[0], tail[1], tail[2:]
            tail = "{" + first + "}" + (second if second == "{" else "{" + second + "}") + rest
        rewritten.append(tail)
    return "\\frac".join(rewritten)


def _is_plain_int(s: str) -> bool:
    """Written exactly as Python writes the integer (`-3`, not `03`, `+3` or `3.0`)."""
    try:
        return str(int(s)) == s
    except ValueError:
        return False


def _slash_to_frac(s: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are plain integers."""
    sides = s.split("/")
    if len(sides) == 2 and all(_is_plain_int(side) for side in sides):
        return "\\frac{" + sides[0] + "}{" + sides[1] + "}"
    return s


# In this order: markup first (line breaks, negative spaces, doubled backslashes, fraction and
# delimiter commands, degrees, currency, units, percent), then numbers (leading zeros, `x =`,
# unbraced `\sqrt` arguments), then spaces (removed before `\frac` arguments are braced, so
# `\frac 1 2` reads as `\frac12`), and last the spellings of one half.
_MATHD_STEPS: tuple[Callable[[str], str], ...] = (
    _delete("\n", "\\!"),
    lambda s: s.replace("\\\\", "\\"),
    _unify_fractions,
    _delete("\\left", "\\right", "^{\\circ}", "^\\circ", "\\$"),
    _drop_unit_text,
    _delete("\\%"),
    _lead_zero_on_decimals,
    _drop_short_lhs,
    _brace_sqrt_argument,
    _delete(" "),
    _brace_frac_arguments,
    lambda s: "\\frac{1}{2}" if s == "0.5" else s,
    _slash_to_frac,
)


def mathd_normalize_answer(answer: str | None) -> str | None:
    """Tier 1's canonical spelling: outer whitespace and a whole-answer `\\text{}` go first,
    then `_MATHD_STEPS`. An empty answer stays empty."""
    if answer is None:
        return None
    answer = answer.strip()
    body = _text_body(answer)
    if body is not None:
        answer = body.strip()
    s = answer
    try:
        for step in _MATHD_STEPS:
            s = step(s)
    except _Malformed:
        return answer
    return s


# --- tier 2: sympy -----------------------------------------------------------------------------

# Words read as units (with plural `s`/`es` and a power such as `^2`) and dropped.
_UNIT_WORDS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
    "month", "year", "foot", "feet", "inch", "yard",
)  # fmt: skip
_SCALE_WORDS = (("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
_TUPLE_BRACKETS = "()[]"


def _float_or_none(s: str) -> float | None:
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def _is_whole(x: float) -> bool:
    """Within 1e-7 of an integer (and finite)."""
    return math.isfinite(x) and abs(x - round(x)) <= 1e-7


def _drop_thousands_commas(s: str) -> str:
    """`1,000,000` -> `1000000`; a comma not followed by exactly three digits (a tuple's)
    stays."""
    while True:
        fewer = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", s)
        if fewer == s:
            return s
        s = fewer


def _int_text(s: str) -> str | None:
    """The integer `s` spells (thousands commas allowed, `3.0`, `1e3`), truncated toward zero,
    or None when it spells no whole number."""
    x = _float_or_none(_drop_thousands_commas(s))
    return str(int(x)) if x is not None and _is_whole(x) else None


@functools.cache
def _warn_no_pylatexenc() -> None:
    log.warning(
        "pylatexenc is not installed: the Miles sympy tier reads LaTeX as written, so e.g. "
        "\\dfrac{3}{4} vs 0.75 scores 0 where Miles scores 1 (pip install 'millstream[reward]')"
    )


# Characters pylatexenc writes that sympy would not read.
_LATEX_TEXT_TO_SYMPY = (
    ("√", "sqrt"),
    ("π", "pi"),
    ("∞", "inf"),
    ("∪", "U"),
    ("·", "*"),
    ("×", "*"),
)


def _latex_to_plain(s: str) -> str:
    """LaTeX rendered as plain text by pylatexenc (`\\frac{1}{2}` -> `1/2`); a space is put
    before every `\\frac` so that a mixed number `7\\frac{3}{4}` reads as `7 3/4`. Without
    pylatexenc, or when it fails, the text is returned as it came."""
    try:
        from pylatexenc.latex2text import LatexNodes2Text
    except ImportError:
        _warn_no_pylatexenc()
        return s
    spaced = s.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    spaced = spaced.replace("\\frac", " \\frac")
    try:
        text = LatexNodes2Text().latex_to_text(spaced)
    except Exception:  # pylatexenc is lenient; a parse it gives up on keeps the LaTeX
        return s
    for char, word in _LATEX_TEXT_TO_SYMPY:
        text = text.replace(char, word)
    return text.strip()


def _sympy_form(answer: str | None) -> str | None:
    """Tier 2's spelling, lower case and without spaces or braces, in this order: the
    whole-answer `\\text{}` goes; `$` and `%` go; `or`/`and` become commas; scale words become
    powers of ten; unit words and degrees go; one outer pair of braces and `,\\!` thousands
    separators go; a whole float is written as an integer; remaining LaTeX goes through
    pylatexenc; `- 3` closes up to `-3` and a mixed number `7 3/4` becomes `7+3/4`; finally an
    answer that spells an integer is written as that integer."""
    if answer is None:
        return None
    body = _text_body(answer)
    s = answer if body is None else body
    s = s.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    s = s.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in _SCALE_WORDS:
        s = s.replace(word, power)
    for unit in _UNIT_WORDS:
        s = re.sub(unit + r"(es)?(s)? *(\^[0-9]+)?", "", s)
    s = re.sub(r"\^ *\\circ", "", s)
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
    s = re.sub(r",\\! *", "", s)
    x = _float_or_none(s)
    if x is not None and _is_whole(x):
        s = str(round(x))
    if "\\" in s:
        s = _latex_to_plain(s)
    s = re.sub(r"- *", "-", s)
    s = re.sub(r"([0-9]) +([0-9])", r"\1+\2", s)
    s = s.replace(" ", "").replace("{", "").replace("}", "").lower()
    return _int_text(s) or s


def split_tuple(s: str) -> list[str]:
    """The elements of `(a, b)` / `[a, b)` (brackets only at the two ends), else `[s]`."""
    s = _drop_thousands_commas(s)
    if not s:
        return []
    inner = s[1:-1]
    if (
        len(s) > 2
        and s[0] in _TUPLE_BRACKETS
        and s[-1] in _TUPLE_BRACKETS
        and not any(b in inner for b in _TUPLE_BRACKETS)
    ):
        return [element.strip() for element in inner.split(",")]
    return [s]


def _is_plain_fraction(s: str) -> bool:
    return re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", s) is not None


def grade_answer_sympy(given_answer: str, ground_truth: str | None) -> bool:
    """Tier 2: equal spellings, or a same-shaped tuple whose elements all agree."""
    want, got = _sympy_form(ground_truth), _sympy_form(given_answer)
    if want is None:
        return False
    if want == got:
        return True
    if not got:
        return False
    want_parts, got_parts = split_tuple(want), split_tuple(got)
    if len(want_parts) > 1 and (want[0] != got[0] or want[-1] != got[-1]):
        return False  # an interval's brackets must agree: (1, 2) is not [1, 2)
    if len(want_parts) != len(got_parts):
        return False
    return all(_elements_agree(w, g) for w, g in zip(want_parts, got_parts, strict=True))


def _elements_agree(want: str, got: str) -> bool:
    if _is_plain_fraction(want) and _is_plain_fraction(got):
        return want == got  # 2/4 is not an answer of 1/2: fractions must be reduced alike
    if (_int_text(want) is None) != (_int_text(got) is None):
        return False  # an integer is only matched by the same integer
    return are_equal_under_sympy(want, got)


_TOO_MANY_LETTERS = 2
# Powers sympy may take forever on: braced or parenthesised exponents, stacked or long ones.
_RISKY_POWER = re.compile(r"\^\{|\^\(|\^[0-9]+\^|\^[0-9][0-9]+")


def should_allow_eval(expr: str) -> bool:
    """Not text or a function of more than two unknowns, and no power sympy may hang on."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    return len(letters) <= _TOO_MANY_LETTERS and _RISKY_POWER.search(expr) is None


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    """sympy simplifies the difference of the two (sympy forms) to 0."""
    expr = f"({ground_truth_normalized})-({given_normalized})"
    if not should_allow_eval(expr):
        return False
    try:
        import sympy
        from sympy.parsing import sympy_parser

        rules = (
            *sympy_parser.standard_transformations,
            sympy_parser.implicit_multiplication_application,
        )
        parsed = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=rules)
        return bool(sympy.simplify(parsed) == 0)
    except Exception:  # anything sympy cannot read or simplify is "not shown equal"
        return False
