"""OpenAI-compatible /v1/models, /v1/completions and /v1/chat/completions.

The same scheduler serves them: a body becomes SGLang sampling params (max_tokens ->
max_new_tokens, seed -> sampling_seed; SGLang's extras top_k, min_p, ignore_eos,
stop_token_ids, no_stop_trim, skip_special_tokens are accepted too), chat messages go
through the tokenizer's chat template with the generation prompt. Both endpoints stream
(`stream: true`: SSE deltas, then `data: [DONE]`, with a usage chunk when
`stream_options.include_usage`).

Limits, each rejected with a 400 that says so: no tools, no non-text content, no penalties
or logit_bias, no echo. `logprobs` reports the chosen token's logprob only: top
alternatives lists hold just that token.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError, model_validator

from ..core import EngineCore
from ..scheduler import RequestError
from ..sequence import output_text
from .generation import Item, Job, make_job, output_of, sse, submit, updates, wait_done
from .protocol import SamplingParamsIn, Strict

router = APIRouter()


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _OpenAICommon(Strict):
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = 1.0
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # SGLang's extras.
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _no_bias(self) -> _OpenAICommon:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by the millstream CPU engine")
        return self

    def sampling(self, max_new_tokens: int | None) -> SamplingParamsIn:
        try:
            return SamplingParamsIn(
                max_new_tokens=max_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                no_stop_trim=self.no_stop_trim,
                n=self.n,
                sampling_seed=self.seed,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
            )
        except ValidationError as err:
            raise RequestError("; ".join(_describe(e) for e in err.errors())) from err


def _describe(error: Any) -> str:
    field = ".".join(str(x) for x in error.get("loc", ()))
    return f"{field}: {error.get('msg', 'invalid')}"


class CompletionReqIn(_OpenAICommon):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    best_of: int | None = None
    suffix: None = None


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatReqIn(_OpenAICommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _finish(item: Item) -> str | None:
    finish = item.seq.finish
    return None if finish is None else finish.type


def _usage(job: Job) -> dict[str, int]:
    # Each prompt counts once, however many samples (n) it had.
    prompts = {s.request_rid: len(s.prompt_ids) for s in job.seqs}
    prompt = sum(prompts.values())
    completion = sum(len(s.output_ids) for s in job.seqs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _completion_prompts(core: EngineCore, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [core.tokenizer.encode(prompt)]
    if prompt and isinstance(prompt[0], str):
        return [core.tokenizer.encode(p) for p in prompt]
    if prompt and isinstance(prompt[0], list):
        return prompt
    return [prompt]


def _chat_prompt(core: EngineCore, req: ChatReqIn) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = core.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(req.chat_template_kwargs or {})
        )
    except Exception as err:  # template errors are the request's fault (roles, kwargs)
        raise RequestError(f"messages: the chat template failed: {err}") from err
    return core.tokenizer.encode(text, add_special_tokens=False)


def _job(core: EngineCore, prompts: list[list[int]], params: SamplingParamsIn, lp: bool) -> Job:
    # A request rid per prompt lets _usage count each prompt once across its n samples.
    rids: list[str | None] = [uuid.uuid4().hex for _ in prompts]
    return make_job(
        core, prompts, [params] * len(prompts), rids, [lp] * len(prompts), force_list=True
    )


def _completion_logprobs(core: EngineCore, item: Item) -> dict[str, Any]:
    tokens = [core.tokenizer.decode([t]) for t in item.seq.output_ids]
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    lps = item.seq.output_logprobs
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)],
        "text_offset": offsets,
    }


def _chat_logprobs(core: EngineCore, item: Item, start: int = 0) -> dict[str, Any]:
    content = []
    end = len(item.seq.output_logprobs)  # the lists may grow while we read them
    ids, lps = item.seq.output_ids[start:end], item.seq.output_logprobs[start:end]
    for tid, lp in zip(ids, lps, strict=True):
        token = core.tokenizer.decode([tid])
        entry = {"token": token, "logprob": lp, "bytes": list(token.encode())}
        content.append({**entry, "top_logprobs": [entry]})
    return {"content": content}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    core: EngineCore = request.app.state.core
    card = {
        "id": core.config.model_name,
        "object": "model",
        "created": int(core.started_at),
        "owned_by": "millstream",
        "root": core.runner.model_path,
        "max_model_len": core.scheduler.context_length,
    }
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(req: CompletionReqIn, request: Request) -> Any:
    core: EngineCore = request.app.state.core
    if req.best_of not in (None, req.n):
        raise RequestError("best_of: only best_of == n is supported")
    prompts = _completion_prompts(core, req.prompt)
    job = _job(core, prompts, req.sampling(req.max_tokens), req.logprobs is not None)
    meta, streaming = await _run(
        core, job, req, request, "cmpl", "text_completion", _completion_delta
    )
    if streaming is not None:
        return streaming
    choices = []
    for i, item in enumerate(job.items):
        choice = {
            "index": i,
            "text": output_of(core, item, False)["text"],
            "finish_reason": _finish(item),
        }
        choice["logprobs"] = _completion_logprobs(core, item) if req.logprobs is not None else None
        choices.append(choice)
    return {**meta, "object": "text_completion", "choices": choices, "usage": _usage(job)}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatReqIn, request: Request) -> Any:
    core: EngineCore = request.app.state.core
    prompt = _chat_prompt(core, req)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    job = _job(core, [prompt], req.sampling(max_new), req.logprobs)
    meta, streaming = await _run(
        core, job, req, request, "chatcmpl", "chat.completion.chunk", _chat_delta
    )
    if streaming is not None:
        return streaming
    choices = []
    for i, item in enumerate(job.items):
        message = {"role": "assistant", "content": output_text(core.tokenizer, item.seq)}
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": _chat_logprobs(core, item) if req.logprobs else None,
                "finish_reason": _finish(item),
            }
        )
    return {**meta, "object": "chat.completion", "choices": choices, "usage": _usage(job)}


async def _run(
    core: EngineCore,
    job: Job,
    req: Any,
    request: Request,
    id_prefix: str,
    chunk_kind: str,
    delta_of: Any,
) -> tuple[dict[str, Any], StreamingResponse | None]:
    """Submit the job; a streamed request gets its SSE response back at once, any other waits
    until the job is done (or the client leaves). The answer's id, created time and model."""
    meta = {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": core.config.model_name,
    }
    submit(core, job)
    if req.stream:
        chunks = _stream(core, job, req, meta, chunk_kind, delta_of)
        return meta, StreamingResponse(chunks, media_type="text/event-stream")
    await wait_done(core, job, request.receive)
    return meta, None


def _completion_delta(
    core: EngineCore, item: Item, text: str, start: int, lp: bool
) -> dict[str, Any]:
    return {"text": text, "logprobs": None}


def _chat_delta(core: EngineCore, item: Item, text: str, start: int, lp: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": text}
    if start == 0:
        delta["role"] = "assistant"
    return {"delta": delta, "logprobs": _chat_logprobs(core, item, start) if lp else None}


async def _stream(
    core: EngineCore, job: Job, req: Any, meta: dict[str, Any], kind: str, delta_of: Any
) -> AsyncIterator[str]:
    """OpenAI SSE: per choice, the text added since the last chunk. A trailing U+FFFD (an
    incomplete UTF-8 sequence) is held back until the next token completes it."""
    sent_text = [""] * len(job.items)
    sent_tokens = [0] * len(job.items)
    want_lp = bool(req.logprobs) if kind != "text_completion" else req.logprobs is not None
    async for i, item, done in updates(core, job):
        upto = None if done else len(item.seq.output_logprobs)
        text = output_text(core.tokenizer, item.seq, upto)
        if not done:
            text = text.rstrip("\ufffd")
        piece = text[len(sent_text[i]) :] if text.startswith(sent_text[i]) else ""
        choice = {"index": i, **delta_of(core, item, piece, sent_tokens[i], want_lp)}
        choice["finish_reason"] = _finish(item) if done else None
        sent_text[i] = sent_text[i] + piece
        sent_tokens[i] = len(item.seq.output_logprobs)
        yield sse({**meta, "object": kind, "choices": [choice]})
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({**meta, "object": kind, "choices": [], "usage": _usage(job)})
    yield "data: [DONE]\n\n"
