"""On-policy distillation from a teacher engine (--opd-teacher-url): the teacher's logprob of
every response token, asked of any server with SGLang's `/generate` (an engine, or a router
in front of several).

One request per chunk of samples: the whole sequence as `input_ids`, `max_new_tokens: 0`,
`return_logprob` with `logprob_start_len` = the prompt's length - 1. SGLang's
`input_token_logprobs` starts with a null entry (the first position it covers has no
logprob), then log P(token_j | tokens_<j) for j = start + 1 ..: exactly the response tokens. The temperature is the
rollout's, as for the student's logprobs (algorithms.advantages compares the two).
"""

from __future__ import annotations

import dataclasses

import httpx

from millstream.common.errors import MillstreamError
from millstream.common.http_pool import make_client

from .backends.base import TrainSample

CHUNK = 64


class TeacherClient:
    def __init__(self, url: str, temperature: float, timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.temperature = temperature
        self.client = make_client(httpx.Timeout(timeout_s))

    async def score(self, samples: list[TrainSample]) -> list[TrainSample]:
        """The samples with `teacher_logprobs` filled in."""
        out: list[TrainSample] = []
        for lo in range(0, len(samples), CHUNK):
            chunk = samples[lo : lo + CHUNK]
            logprobs = await self._logprobs(chunk)
            out += [
                dataclasses.replace(s, teacher_logprobs=lp)
                for s, lp in zip(chunk, logprobs, strict=True)
            ]
        return out

    async def _logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        body = {
            "input_ids": [s.tokens for s in samples],
            "sampling_params": {"max_new_tokens": 0, "temperature": self.temperature},
            "return_logprob": True,
            "logprob_start_len": [s.prompt_len - 1 for s in samples],
        }
        try:
            resp = await self.client.post(f"{self.url}/generate", json=body)
        except httpx.HTTPError as err:
            raise MillstreamError(f"teacher engine {self.url} unreachable: {err!r}") from err
        if resp.status_code != 200:
            raise MillstreamError(
                f"teacher engine {self.url}/generate answered {resp.status_code}: {resp.text[:300]}"
            )
        items = resp.json()
        items = items if isinstance(items, list) else [items]
        out = []
        for s, item in zip(samples, items, strict=True):
            entries = item["meta_info"]["input_token_logprobs"]
            logprobs = [float(e[0]) for e in entries[1:]]
            if len(logprobs) != s.response_len:
                raise MillstreamError(
                    f"teacher engine {self.url} scored {len(logprobs)} of {s.response_len} "
                    "response tokens (does it support logprob_start_len?)"
                )
            out.append(logprobs)
        return out

    async def close(self) -> None:
        await self.client.aclose()
