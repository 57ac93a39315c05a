"""Final-answer extraction and math equivalence for the rule-based rewards.

Extraction (hand-written, no dependencies):

* `last_boxed(text)`: the contents of the last `\\boxed{...}` (or `\\fbox{...}`), matching
  nested braces, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`.
* `last_number(text)`: the last number written in the text (`-3`, `1,000`, `0.5`, `.5`, `3/4`).
* `extract_answer(text)`: the boxed answer, else the last number.

Equivalence, `is_equiv(pred, label)`, in two tiers:

1. Fast path, hand-written: both sides go through `normalize` (whitespace, `\\left`/`\\right`,
   `\\dfrac`/`\\tfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`, `^\\circ`, `\\$`, `\\%`,
   `\\text{...}` and trailing units, thousands separators, `x = ` prefixes, trailing `.0`).
   Two plain numbers (integer, decimal, `a/b`, `\\frac{a}{b}`) of equal exact value
   (`0.5` == `\\frac{1}{2}` == `1/2`, `2.0` == `2`, `1,000` == `1000`) answer "equal" at once:
   most answers in math data are integers or simple fractions, and this path costs
   microseconds. Any other pair, even one the normaliser finds equal, goes to tier 2, so
   `is_equiv` never says "equal" where math-verify says "not equal" (the normaliser alone
   would equate `x=5` and `y=5`, or `3\\,000` and `3000`).
2. Otherwise math-verify (Hugging Face's `math_verify.parse` + `verify`, sympy-backed) decides:
   it handles what a string normaliser cannot (`\\frac{\\sqrt{2}}{2}` vs `\\frac{1}{\\sqrt{2}}`,
   `(x+1)^2` vs `x^2+2x+1`, intervals, sets). Its own signal.alarm timeouts are switched off
   because they only work on the main thread; the scorer enforces `--reward-timeout` around
   the whole reward instead. A parse that yields nothing, or an error inside math-verify,
   counts as not equal: a malformed answer is a wrong answer, not an infrastructure failure.

math-verify imports sympy but not torch, so the reward worker stays torch-free.
"""

from __future__ import annotations

import re
from fractions import Fraction

from millstream.common.errors import MillstreamError

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced), or None."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":
        # `\boxed 5`: the argument runs to the next whitespace or `$`.
        match = re.match(r"[^\s$]+", text[i:])
        return match.group(0) if match else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: the model was cut off inside the box


_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in the text, as written (commas kept for `normalize`), or None."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(" ", "") if matches else None


def extract_answer(text: str) -> str | None:
    """The boxed answer if there is one, else the last number, else None."""
    boxed = last_boxed(text)
    return boxed if boxed is not None else last_number(text)


def after_think(text: str) -> str:
    """The part after the last `</think>`: the answer, not the reasoning."""
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


# Removed outright: spacing commands, sizing, degree marks, currency and percent signs.
_DROP = (
    "\\left",
    "\\right",
    "\\!",
    "\\,",
    "\\;",
    "\\:",
    "\\ ",
    "^{\\circ}",
    "^\\circ",
    "\\circ",
    "\\$",
    "$",
    "\\%",
    "%",
    "\\displaystyle",
)
_UNITS = re.compile(
    r"\\(?:text|mbox|mathrm)\{\s*(?:[a-zA-Z]+\s*)+(?:\^\d)?\}(?:\^\{?\d\}?)?$"  # \text{ cm}^2
)
_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{(.*)\}$")
_SHORT_FRAC = re.compile(r"\\frac(\d)(\d)")
_HALF_FRAC = re.compile(r"\\frac(\d)\{")
_SHORT_SQRT = re.compile(r"\\sqrt(\w)")
_THOUSANDS = re.compile(r"(\d),(\d{3})(?=$|\D)")
_VAR_PREFIX = re.compile(r"^[a-zA-Z]\w?=(?!=)")


def normalize(answer: str) -> str:
    """A canonical string for a final answer (see the module docstring for what it strips)."""
    s = answer.strip().replace("\n", "")
    for token in ("\\dfrac", "\\tfrac"):
        s = s.replace(token, "\\frac")
    for token in _DROP:
        s = s.replace(token, "")
    s = s.strip()
    if s.endswith("."):
        s = s[:-1]
    wrapped = _TEXT_WRAP.match(s)
    if wrapped:
        s = wrapped.group(1)
    units = _UNITS.search(s)
    if units and units.start() > 0:  # `10 \text{ cm}`, but never a whole `\text{Paris}`
        s = s[: units.start()].strip()
    s = s.replace(" ", "")
    s = _VAR_PREFIX.sub("", s)
    s = _SHORT_FRAC.sub(r"\\frac{\1}{\2}", s)
    s = _HALF_FRAC.sub(r"\\frac{\1}{", s)
    s = _SHORT_SQRT.sub(r"\\sqrt{\1}", s)
    while True:
        joined = _THOUSANDS.sub(r"\1\2", s)
        if joined == s:
            break
        s = joined
    if len(s) > 1 and s[0] == "{" and s[-1] == "}" and _balanced(s[1:-1]):
        s = s[1:-1]
    value = to_rational(s)
    if value is not None:
        return _rational_text(value)
    return s


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            return False
    return depth == 0


_DECIMAL = re.compile(r"^[+-]?(?:\d+\.?\d*|\.\d+)$")
_SLASH = re.compile(r"^([+-]?\d+)/([+-]?\d+)$")
_FRAC = re.compile(r"^([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}$")


def to_rational(s: str) -> Fraction | None:
    """The exact value of an integer, decimal, `a/b` or `\\frac{a}{b}`; None otherwise."""
    if _DECIMAL.match(s):
        return Fraction(s)
    for pattern in (_SLASH, _FRAC):
        m = pattern.match(s)
        if m:
            *sign, num, den = m.groups()
            if int(den) == 0:
                return None
            value = Fraction(int(num), int(den))
            return -value if sign and sign[0] == "-" else value
    return None


def _rational_text(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def fast_equiv(pred: str, label: str) -> bool:
    """The hand-written tier alone: equal after `normalize` (exact rationals included)."""
    return normalize(pred) == normalize(label)


def math_verify_equiv(pred: str, label: str) -> bool:
    """math-verify's verdict on two extracted answers (both read as LaTeX math)."""
    from math_verify import parse, verify

    try:
        gold = parse(f"${label}$", parsing_timeout=None)
        guess = parse(f"${pred}$", parsing_timeout=None)
        return bool(gold and guess and verify(gold, guess, timeout_seconds=None))
    except Exception:
        # A malformed answer sympy chokes on is a wrong answer, not a failed reward.
        return False


def is_equiv(pred: str | None, label: str | None) -> bool:
    """Is the extracted answer `pred` the same value as `label`? Fast path, then math-verify."""
    if pred is None or label is None:
        return False
    pred, label = pred.strip(), label.strip()
    if not pred or not label:
        return False
    boxed_label = last_boxed(label)
    if boxed_label is not None:
        label = boxed_label
    if fast_equiv(pred, label) and _plain_number(pred) and _plain_number(label):
        return True
    # Anything else is math-verify's call, even when the normaliser found the two equal: it
    # strips what math-verify reads (`x=5` vs `y=5`, `3\\,000` vs `3000`), and is_equiv must
    # never say "equal" where math-verify says "not equal".
    return math_verify_equiv(pred, label)


_PLAIN_NUMBER = re.compile(
    r"^[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+|\d+/\d+|\\[dt]?frac\{\d+\}\{\d+\})$"
)


def _plain_number(text: str) -> bool:
    """An integer, decimal (thousands commas allowed), `a/b` or `\\frac{a}{b}`, nothing else:
    the answers whose fast-path verdict math-verify always shares."""
    return bool(_PLAIN_NUMBER.match(text.replace(" ", "")))


def warm_up() -> None:
    """Import math-verify (and sympy) now and run it once, so the first sample's
    `--reward-timeout` is not spent on imports (see `needs_warm_up`)."""
    try:
        import math_verify  # noqa: F401
    except ImportError as err:
        raise MillstreamError(
            f"math-verify is missing ({err}): reward workers need `pip install millstream[reward]`"
        ) from err
    math_verify_equiv("\\frac{1}{2}", "0.5")
