"""One generation (one output of one prompt) as the scheduler sees it, and when it stops.

A Sequence is created by the API, handed to the scheduler, and from then on mutated only by
the scheduler thread: it appends (token, logprob) pairs, decides when the sequence is
finished, and calls `notify` after every change so the API can stream or answer. Lists only
grow, and `finish` is set after the last append, so a reader on another thread that reads
`finish` first and then the lists sees a complete result.

Stop rules, in SGLang's order (scheduler `check_finished`):
  1. `len(output_ids) >= max_new_tokens`          -> {"type": "length", "length": N}
  2. unless ignore_eos: the last token is in stop_token_ids or is an EOS token
                                                  -> {"type": "stop", "matched": token_id}
  3. a stop string appears in the decoded output  -> {"type": "stop", "matched": "the string"}
`output_ids` keep the matched token; the returned text drops it (and cuts at a matched stop
string) unless `no_stop_trim`, as SGLang's detokenizer does.

Input logprobs (SGLang's `logprob_start_len`): `InputLogprobs.values[k]` belongs to prompt
token `start + k`; values[0] is None (SGLang never scores the first returned position) and
values[k >= 1] = log P(prompt[start + k] | prompt[:start + k]). The scheduler fills `values`
from the prefill logits before the sequence samples or finishes, so a reader that saw a token
or `finish` sees them.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .sampling import SamplingParams


@dataclass(frozen=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out


@dataclass(eq=False)
class InputLogprobs:
    """The input logprobs a request asked for; the n copies of a request share one, so
    they are computed once. `values` is None until the prefill computed them."""

    start: int
    values: list[float | None] | None = None

    @property
    def pending(self) -> bool:
        return self.values is None


def _noop(_: Sequence) -> None:
    return None


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    rng: random.Random  # draws this sequence's sampling uniforms (sampling.py)
    notify: Callable[[Sequence], None] = _noop
    # The rid the client sent, shared by the n copies of a request: /abort_request by it
    # reaches all of them.
    request_rid: str | None = None
    # Set when the request asked for input logprobs (return_logprob).
    input_logprobs: InputLogprobs | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    weight_version: str | None = None
    created_at: float = field(default_factory=time.perf_counter)
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    def prefix_ids(self) -> list[int]:
        """Tokens whose KV must be in the cache before the next decode step: everything but
        the last sampled token, which the next step feeds (it has no KV yet)."""
        return self.prompt_ids + self.output_ids[:-1]

    @property
    def next_position(self) -> int:
        """Position of the token the next decode step feeds (the last sampled one)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def pending_logprob_start(self) -> int | None:
        """`logprob_start_len` while the input logprobs still have to be computed, else None."""
        holder = self.input_logprobs
        return holder.start if holder is not None and holder.pending else None

    def set_finished(self, reason: FinishReason, weight_version: str) -> None:
        self.weight_version = weight_version
        self.finished_at = time.perf_counter()
        self.finish = reason


class StopChecker:
    """Applies the stop rules above; owns the tokenizer calls they need."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int]):
        self._tokenizer = tokenizer
        self._eos_token_ids = frozenset(eos_token_ids)

    def check(self, seq: Sequence) -> FinishReason | None:
        params = seq.params
        if len(seq.output_ids) >= params.max_new_tokens:
            return FinishReason("length", length=len(seq.output_ids))
        last = seq.output_ids[-1]
        if not params.ignore_eos and (last in params.stop_token_ids or last in self._eos_token_ids):
            return FinishReason("stop", matched=last)
        if params.stop:
            text = self._tokenizer.decode(
                seq.output_ids, skip_special_tokens=params.skip_special_tokens
            )
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                return FinishReason("stop", matched=min(hits)[1])
        return None


def output_text(tokenizer: Any, seq: Sequence, upto: int | None = None) -> str:
    """The text SGLang would return for the first `upto` output tokens (all by default)."""
    ids = seq.output_ids if upto is None else seq.output_ids[:upto]
    finish = seq.finish if upto is None or upto == len(seq.output_ids) else None
    trim = finish is not None and finish.type == "stop" and not seq.params.no_stop_trim
    if trim and isinstance(finish.matched, int) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
    if trim and isinstance(finish.matched, str):
        pos = text.find(finish.matched)
        if pos != -1:
            text = text[:pos]
    return text
