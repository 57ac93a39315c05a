"""The built-in rewards (`--rm-type`), Miles/slime compatible in meaning.

    rm_type      reward   what is compared
    math         1 / 0    `extract_answer(response)` (boxed, else last number) vs label
    deepscaler   1 / 0    the boxed answer after `</think>` (whole response without a think block)
    dapo         +1 / -1  the last "Answer: ..." line (else the boxed answer) vs label
    f1           [0, 1]   token-level F1 (SQuAD normalisation: case, punctuation, articles)
    exact        1 / 0    stripped response == stripped label
    remote_rm    any      what the HTTP reward model says (see remote_rm.py)
    boxed_<t>             `<t>` on the last `\\boxed{...}` of the response ("" when none)

Math equivalence (math, deepscaler, dapo) is `math_utils.is_equiv`: a hand-written
normaliser as the fast path, math-verify for everything it cannot settle.

A sample's metadata may name its own built-in rm_type (`{"rm_type": "f1"}`), as in Miles, so
one data set can mix tasks; `--custom-rm-path` wins over both. Only built-ins can be chosen
that way: code is loaded from the run config alone (see plugins.py).

`to_reward` turns what any reward returned into the float stored in `Sample.reward`.
"""

from __future__ import annotations

import math
import numbers
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from millstream.common.errors import MillstreamError

from .math_utils import after_think, extract_answer, is_equiv, last_boxed

BOXED_PREFIX = "boxed_"
REMOTE = "remote_rm"


def math_reward(response: str, label: str) -> float:
    return 1.0 if is_equiv(extract_answer(response), label) else 0.0


def deepscaler_reward(response: str, label: str) -> float:
    return 1.0 if is_equiv(last_boxed(after_think(response)), label) else 0.0


# DAPO reads the answer from the tail of the solution ("Answer: 42"); 300 characters is the
# window its reference scorer uses (the longest MATH-500 answer is ~160 characters).
_DAPO_TAIL = 300
_DAPO_ANSWER = re.compile(r"(?i)answer\s*:\s*([^\n]+)")


def dapo_reward(response: str, label: str) -> float:
    tail = response[-_DAPO_TAIL:]
    found = _DAPO_ANSWER.findall(tail)
    answer = found[-1].strip() if found else last_boxed(tail)
    if answer is not None and answer.endswith("."):
        answer = answer[:-1]
    return 1.0 if is_equiv(answer, label) else -1.0


def _f1_tokens(text: str) -> list[str]:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1_reward(response: str, label: str) -> float:
    pred, gold = _f1_tokens(response), _f1_tokens(label)
    # A yes/no answer is right or wrong as a whole, never half right by sharing a token.
    if {" ".join(pred), " ".join(gold)} & {"yes", "no", "noanswer"} and pred != gold:
        return 0.0
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_reward(response: str, label: str) -> float:
    return 1.0 if response.strip() == label.strip() else 0.0


RULES: dict[str, Callable[[str, str], float]] = {
    "math": math_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "exact": exact_reward,
}
RM_TYPES = (*RULES, REMOTE)
# Plain string work, linear in the response: run on the event loop. Starting a thread per
# sample for these cost more than the rule itself (the reward worker's top cost, py-spy).
INSTANT_RULES = frozenset({"exact", "f1"})


def split_rm_type(rm_type: str) -> tuple[bool, str]:
    """(boxed first?, base type); MillstreamError naming the type when it is not built in."""
    name = rm_type.strip()
    boxed = name.startswith(BOXED_PREFIX)
    base = name[len(BOXED_PREFIX) :] if boxed else name
    if base not in RM_TYPES:
        choices = ", ".join(RM_TYPES)
        raise MillstreamError(
            f"unknown rm_type {rm_type!r}: built-ins are {choices} (each may take the "
            f"{BOXED_PREFIX} prefix); for your own reward use --custom-rm-path pkg.mod.fn"
        )
    return boxed, base


def rule_reward(rm_type: str, response: str, label: str) -> float:
    """A rule-based (not remote) built-in reward of one response."""
    boxed, base = split_rm_type(rm_type)
    if base == REMOTE:
        raise ValueError("remote_rm is not a rule-based reward")
    if boxed:
        response = last_boxed(response) or ""
    return RULES[base](response, label)


def to_reward(value: Any, reward_key: str | None) -> float:
    """The float a reward returned: a number, or a dict read at reward_key / "reward" / "score".

    Raises (an infrastructure failure, never a 0) on anything else, NaN and infinities included.
    """
    if isinstance(value, dict):
        keys = [reward_key] if reward_key else ["reward", "score"]
        key = next((k for k in keys if k in value), None)
        if key is None:
            hint = f"--reward-key {reward_key!r}" if reward_key else "'reward' or 'score'"
            raise ValueError(f"reward dict has no {hint} key (keys: {sorted(value)[:10]})")
        value = value[key]
    if isinstance(value, numbers.Real):  # bools, ints, floats, numpy scalars
        reward = float(value)
        if math.isfinite(reward):
            return reward
    raise ValueError(f"reward must be a finite number (got {value!r})")
