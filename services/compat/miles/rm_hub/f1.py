"""Miles' `miles.rollout.rm_hub.f1`: token-level F1 with SQuAD's normalisation.

`f1_score(prediction, ground_truth)` is (f1, precision, recall) over the words both share
(counted with multiplicity) after `normalize_answer`: lower case, punctuation gone, the
articles a/an/the gone, whitespace collapsed. A yes / no / noanswer on either side is right or
wrong as a whole, never half right by sharing a word; no prediction, or no shared word, is
(0, 0, 0). The `f1` rm_type's reward is the first of the three.
"""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["f1_score", "normalize_answer"]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_WHOLE_ANSWERS = ("yes", "no", "noanswer")
_ZERO = (0, 0, 0)


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    if prediction is None:
        return _ZERO
    pred, gold = normalize_answer(prediction), normalize_answer(ground_truth)
    if pred != gold and (pred in _WHOLE_ANSWERS or gold in _WHOLE_ANSWERS):
        return _ZERO
    pred_words, gold_words = pred.split(), gold.split()
    shared = sum((Counter(pred_words) & Counter(gold_words)).values())
    if shared == 0:
        return _ZERO
    precision, recall = shared / len(pred_words), shared / len(gold_words)
    return 2 * precision * recall / (precision + recall), precision, recall
