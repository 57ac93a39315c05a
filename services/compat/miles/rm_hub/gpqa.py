"""Miles' `miles.rollout.rm_hub.gpqa`: the `gpqa` grader for multiple choice, 1.0 or 0.0.

`compute_gpqa_reward(response, label, metadata)` decides the right letter, in this order:
metadata["correct_letter"]; a one-letter string label; a numeric label as an index into the
valid letters; the choice (metadata["choices"], a list or a dict's values) whose text equals
the label's, ignoring case and punctuation (recorded as metadata["correct_answer"], as Miles
does). Valid letters are metadata["valid_letters"], else A.. for as many choices, else A-H.

The response, after its last `</think>`, names a letter ("answer is C", "option: C", "C is
correct", "final answer C"; else its last standalone valid capital). The reward is 1.0 when
the letters agree; without both letters, 1.0 when the response's text contains the right
choice's, metadata["correct_answer"] / ["answer_text"] or the label's (each normalised);
else 1.0 only when the response's letter is the label itself.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable
from typing import Any

__all__ = ["DEFAULT_VALID_LETTERS", "compute_gpqa_reward"]

DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:8])

_LETTER_PATTERNS = (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])",
)


def _after_thinking(text: str) -> str:
    return text.rpartition("</think>")[2] if text else ""


def _plain(text: str) -> str:
    """Lower case, every run of other than letters and digits one space."""
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _letter_in(response: str, valid_letters: Iterable[str]) -> str | None:
    """The option letter the response picks, best effort; None when it names none."""
    if not response:
        return None
    text = _after_thinking(response)
    valid = {letter.upper() for letter in valid_letters}
    for pattern in _LETTER_PATTERNS:
        found = re.search(pattern, text, flags=re.IGNORECASE)
        if found and found.group(1).upper() in valid:
            return found.group(1).upper()
    for letter in reversed(re.findall(r"\b([A-Z])\b", text)):
        if letter in valid:
            return letter
    return None


def compute_gpqa_reward(response: str | None, label: Any, metadata: dict | None = None) -> float:
    if response is None:
        return 0.0
    metadata = metadata if metadata is not None else {}
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        choices = list(choices.values())
    elif choices is not None:
        choices = list(choices)
    if metadata.get("valid_letters"):
        letters = [str(letter).upper() for letter in metadata["valid_letters"]]
    elif choices:
        letters = list(string.ascii_uppercase[: len(choices)])
    else:
        letters = DEFAULT_VALID_LETTERS
    right = metadata.get("correct_letter")
    right = right.strip().upper() if isinstance(right, str) else None

    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in letters and not right:
            right = label_text.upper()
    elif isinstance(label, int | float) and 0 <= int(label) < len(letters):
        right = letters[int(label)]
    if not right and choices and label_text:
        for i, choice in enumerate(choices):
            if _plain(str(choice)) == _plain(label_text):
                right = letters[i]
                metadata.setdefault("correct_answer", choice)
                break

    picked = _letter_in(response, letters)
    if picked and right:
        return 1.0 if picked == right else 0.0

    targets = []
    if right and choices and right in letters and letters.index(right) < len(choices):
        targets.append(str(choices[letters.index(right)]))
    targets += [
        str(metadata[key]) for key in ("correct_answer", "answer_text") if metadata.get(key)
    ]
    if label_text:
        targets.append(label_text)
    said = _plain(_after_thinking(response))
    if any(target and target in said for target in {_plain(t) for t in targets if t}):
        return 1.0
    if picked and not right and label_text:
        return 1.0 if picked == label_text.upper() else 0.0
    return 0.0
