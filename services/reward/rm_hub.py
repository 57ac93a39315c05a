"""The built-in rewards (`--rm-type`): Miles' values, value for value (`--rm-compat miles`).

With `--rm-compat miles` (the default) every Miles rm_type below calls Miles' grader, the
very function a plugin gets from `miles.rollout.rm_hub` (millstream.compat.miles.rm_hub), so a
(response, label) pair gets the reward Miles gives it, edge cases included
(tests/unit/reward/test_rm_miles_parity.py):

    rm_type      reward   Miles function (miles/rollout/rm_hub/)
    math         1 / 0    math_utils.grade_answer_verl: the last \\boxed{} only (no box: 0)
    deepscaler   1 / 0    deepscaler.get_deepscaler_rule_based_reward: the box after the last
                          `</think>` (or the first `###Response`); neither: 0
    dapo         +1 / -1  math_dapo_utils.compute_score: the last "Answer: ..." in the last 300
                          characters, string-compared after Minerva normalisation; the label
                          must be an integer (Miles raises otherwise, and so do we)
    f1           [0, 1]   f1.f1_score: token-level F1 (SQuAD normalisation)
    exact        1 / 0    millstream's own (Miles has none): see below
    remote_rm    any      what the HTTP reward model says (see remote_rm.py)
    boxed_<t>             `<t>` on the last `\\boxed{...}` of the response ("" when none)

`--rm-compat millstream` is millstream's own, more lenient reading, on purpose and only when
asked: math falls back to the last number when there is no box, deepscaler scores the whole
response when there is no `</think>`, dapo falls back to the box and compares with math
equivalence; their equivalence is `math_utils.is_equiv` (a fast path that never says "equal"
where math-verify says "not equal", then math-verify). f1 is the same in both.

`exact` scores the response as the model produced it: the response tokens decoded without
skipping special tokens (a BOS or pad inside the answer makes it wrong even when
`--rollout-skip-special-tokens` hides it from the text), less the stop token that ended it. A
response cut by the length limit (no EOS: "82" then padding) or aborted scores 0; one whose EOS
is exactly the last token allowed (finish_reason "length", as SGLang reports it) is finished.
The tokens are decoded with --hf-checkpoint's tokenizer, which must load: a worker whose
--rm-type is `exact` fails at start when it cannot (check_tokenizer), never scoring the text
instead; without --hf-checkpoint the text is scored.
Like Miles, the other built-ins score a truncated response by its text (Miles' rm_hub never
looks at Sample.status; the text is what SGLang returned, with no_stop_trim and
`--rollout-skip-special-tokens` as set).

A sample's metadata may name its own built-in rm_type (`{"rm_type": "f1"}`), as in Miles, so
one data set can mix tasks; `--custom-rm-path` wins over both. Only built-ins can be chosen
that way: code is loaded from the run config alone (see compat/plugins.py).

`to_reward` turns what any reward returned into the float stored in `Sample.reward` (Miles'
dapo returns a dict: its "score" is taken unless `--reward-key` says otherwise).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import numbers
import os
import re
from collections.abc import Callable
from typing import Any

from millstream.common.errors import MillstreamError
from millstream.compat.miles.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from millstream.compat.miles.rm_hub.f1 import f1_score
from millstream.compat.miles.rm_hub.math_dapo_utils import compute_score
from millstream.compat.miles.rm_hub.math_utils import extract_answer as miles_boxed
from millstream.compat.miles.rm_hub.math_utils import grade_answer_verl

from .math_utils import after_think, extract_answer, is_equiv, last_boxed

log = logging.getLogger(__name__)

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


def f1_reward(response: str, label: str) -> float:
    """Miles' f1.f1_score's F1, in both compat modes."""
    return float(f1_score(response, label)[0])


def exact_reward(response: str, label: str, finish_reason: str | None = None) -> float:
    """1 when the stripped response is the stripped label and the response was finished: one
    cut by the length limit (no EOS) or aborted is not an answer. No finish_reason (a bare
    string) is taken as finished."""
    if finish_reason in ("length", "abort"):
        return 0.0
    return 1.0 if response.strip() == label.strip() else 0.0


RULES: dict[str, Callable[[str, str], float]] = {
    "math": math_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "exact": exact_reward,
}
RM_TYPES = (*RULES, REMOTE)
COMPAT = ("miles", "millstream")


def miles_rule(base: str, response: str, label: str) -> Any:
    """Miles' value (miles/rollout/rm_hub/__init__.py async_rm) for a Miles rm_type."""
    if base == "math":
        return 1 if grade_answer_verl(response, label) else 0
    if base == "deepscaler":
        return get_deepscaler_rule_based_reward(response, label)
    if base == "dapo":
        try:
            return compute_score(response, label)
        except ValueError as err:  # Miles: int(float(label)) on a label that is no integer
            raise ValueError(
                f"dapo (as in Miles) needs an integer label, got {label!r} ({err}); "
                "--rm-compat millstream compares any answer by math equivalence"
            ) from None
    return f1_score(response, label)[0]


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


def rule_reward(
    rm_type: str,
    response: str,
    label: str,
    *,
    compat: str = "miles",
    finish_reason: str | None = None,
) -> Any:
    """A rule-based (not remote) built-in reward of one response: a number, or Miles' dapo
    dict (read it with `to_reward`). `finish_reason` is the engine's (stop, length, abort)."""
    boxed, base = split_rm_type(rm_type)
    if base == REMOTE:
        raise ValueError("remote_rm is not a rule-based reward")
    if compat not in COMPAT:
        raise MillstreamError(f"unknown --rm-compat {compat!r}: choose from {', '.join(COMPAT)}")
    miles = compat == "miles"
    if boxed:
        # Miles: math_utils.extract_answer, which needs `\boxed{` (an `\fbox` alone is "").
        response = (miles_boxed(response) if miles else last_boxed(response)) or ""
    if base == "exact":
        return exact_reward(response, label, finish_reason)
    if miles:
        return miles_rule(base, response, label)
    return RULES[base](response, label)


def sample_rule_reward(rm_type: str, sample: Any, cfg: Any) -> Any:
    """`rule_reward` of a wire Sample under a RunConfig: the reward worker's entry point. Gives
    `exact` the response as the model produced it (`produced_text`) and the finish reason."""
    response, finish = sample.response_text, sample.finish_reason or None
    if split_rm_type(rm_type)[1] == "exact":
        response, finish = produced_text(sample, cfg)
    return rule_reward(
        rm_type, response, sample.label, compat=cfg.reward.rm_compat, finish_reason=finish
    )


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> tuple[Any, frozenset[int], frozenset[int]]:
    """(tokenizer, the ids generation stops on: its EOS and generation_config.json's, its
    special ids) of the model dir `path` (the run's --hf-checkpoint), read from tokenizer.json
    with the `tokenizers` library: transformers' AutoTokenizer would import torch into every
    reward worker (+220 MB each, measured). MillstreamError naming the path when it cannot
    be loaded: `exact` never falls back to the response text, which would change the reward."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise MillstreamError(
            f"the exact reward decodes responses with --hf-checkpoint {path}'s tokenizer, and "
            f"the tokenizers package is not installed here ({err})"
        ) from None
    file = os.path.join(path, "tokenizer.json")
    try:
        tok = Tokenizer.from_file(file)
    except Exception as err:
        why = "no such file" if not os.path.exists(file) else f"{type(err).__name__}: {err}"
        raise MillstreamError(
            f"the exact reward cannot load the tokenizer of --hf-checkpoint {path} ({file}: "
            f"{why}): is the model dir there, at this path, on this machine?"
        ) from None
    special = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    eos: set[int] = set()
    eos_token = _json_file(f"{path}/tokenizer_config.json").get("eos_token")
    if isinstance(eos_token, dict):  # an AddedToken written out
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str) and tok.token_to_id(eos_token) is not None:
        eos.add(tok.token_to_id(eos_token))
    gen = _json_file(f"{path}/generation_config.json").get("eos_token_id")
    eos.update(gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else [])
    return tok, frozenset(eos), special


def check_tokenizer(cfg: Any) -> None:
    """At a reward worker's start: when the run's --rm-type is `exact` (plain or boxed_) and
    the run config names --hf-checkpoint, its tokenizer loads here, or the worker fails now,
    naming the path. A sample whose metadata asks for `exact` in a run of another --rm-type
    loads it on first use, and a failure there fails that group with the same message."""
    r, path = cfg.reward, cfg.ckpt.hf_checkpoint
    if path and r.rm_type and not r.custom_rm_path and split_rm_type(r.rm_type)[1] == "exact":
        load_tokenizer(str(path))


def _json_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def produced_text(sample: Any, cfg: Any) -> tuple[str, str | None]:
    """(the response as the model produced it, how it ended): its tokens decoded with special
    tokens kept, less the stop that ended it (after a "stop": the last token when it is an EOS,
    a --rollout-stop-token-ids or another special token; text from the first --rollout-stop
    string on).

    A response whose last token is a stop token ended by it even when the engine says
    "length": like SGLang, the engine checks the length limit first, so an answer whose EOS is
    exactly the last token allowed is reported as "length" (Miles marks it TRUNCATED), yet the
    model did finish it. Without --hf-checkpoint in the run config, or without tokens:
    (response_text, finish_reason); a --hf-checkpoint whose tokenizer cannot be loaded raises
    (load_tokenizer), so the sample's reward fails instead of scoring other text."""
    finish = sample.finish_reason or None
    path = cfg.ckpt.hf_checkpoint
    ids = list(sample.response_token_ids)
    if not path or not ids:
        return sample.response_text, finish
    tok, eos, special = load_tokenizer(str(path))
    stop_ids = eos | set(cfg.rollout.rollout_stop_token_ids or ())
    if finish == "stop" and (ids[-1] in stop_ids or ids[-1] in special):
        ids = ids[:-1]  # the token the engine stopped on
    elif finish == "length" and ids[-1] in stop_ids:
        ids, finish = ids[:-1], "stop"  # its EOS was the last token allowed: finished
    text = tok.decode(ids, skip_special_tokens=False)
    if finish == "stop" and cfg.rollout.rollout_stop:
        hits = [text.find(s) for s in cfg.rollout.rollout_stop if s and s in text]
        if hits:
            text = text[: min(hits)]
    return text, finish


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
