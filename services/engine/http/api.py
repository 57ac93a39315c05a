"""The engine's HTTP app: SGLang's native /generate and info endpoints, Prometheus /metrics
(engine/prom.py), plus error shape.

Errors. Every client mistake is a 4xx with the body SGLang's OpenAI layer uses,
`{"object": "error", "message": ..., "type": "BadRequestError", "param": ..., "code": 400}`,
where the message names the offending field (`sampling_params.top_k: ...`). Malformed JSON
and unknown fields are 400s too (pydantic models forbid extras), never 5xx.

Admin endpoints (http/control.py) need the admin token when one is set; everything here is
open. A body over --max-request-bytes is refused with 413 before it is read.

Tracing: /generate runs in a `text_completion <model>` span whose parent is the W3C context of
the request headers, so a prompt group's trace crosses rollout worker -> router -> engine; a
request serving several groups (X-Millstream-Groups) links the span to each group's and records
their ids (common/telemetry.py `served_groups`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from millstream.common import aio, telemetry
from millstream.common.http_limits import BodyLimit
from millstream.common.prom import CONTENT_TYPE, render
from millstream.common.telemetry import STAGE, context_from_headers, served_groups, tracer

from ..core import EngineCore
from ..prom import engine_registry
from ..scheduler import RequestError
from .control import Fenced, Unauthorized
from .control import router as control_router
from .generation import Job, job_from_generate, output_of, stream_outputs, submit, wait_done
from .openai import router as openai_router
from .protocol import GenerateReqIn

router = APIRouter()


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    if status == 401:
        kind = "AuthenticationError"
    body = {"object": "error", "message": message, "type": kind, "param": param, "code": status}
    return JSONResponse(body, status_code=status)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """One line naming each offending field, e.g. `sampling_params.top_k: ...`."""
    found: list[tuple[str, str]] = []
    for item in err.errors():
        if item.get("type") == "json_invalid":
            detail = (item.get("ctx") or {}).get("error", "malformed")
            pos = item.get("loc", ("body", "?"))[-1]
            return f"body: invalid JSON at character {pos} ({detail})", None
        # Union members appear in loc as type names ("list[int]"); they name no field.
        loc = [str(x) for x in item.get("loc", ()) if x != "body" and not str(x).endswith("]")]
        found.append((".".join(loc), item.get("msg", "invalid")))
    # For a union (`x` may be an object or a list), keep the branch that got furthest.
    fields = [f for f, _ in found]
    kept = [(f, m) for f, m in found if not any(g.startswith(f + ".") for g in fields if f)]
    parts = dict.fromkeys(f"{f or 'body'}: {m}" for f, m in kept)
    return "; ".join(parts), (kept[0][0] or None) if kept else None


class JSONBodyMiddleware:
    """Treat every POST body as JSON, whatever Content-Type the client sent (`curl -d`
    sends a form type); the models then validate it."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def core_of(request: Request) -> EngineCore:
    return request.app.state.core


@router.post("/generate")
async def generate(req: GenerateReqIn, request: Request) -> Any:
    core = core_of(request)
    span_ctx = context_from_headers(request.headers)
    served, links = served_groups(request.headers)
    job = job_from_generate(core, req)
    if req.stream:
        submit(core, job)
        chunks = _traced_stream(core, job, span_ctx, served, links)
        return StreamingResponse(chunks, media_type="text/event-stream")
    name, attributes = _generation_span(core, job)
    with tracer("millstream.engine").start_as_current_span(
        name, context=span_ctx, attributes={**attributes, **served}, links=links
    ) as span:
        submit(core, job)
        await wait_done(core, job, request.receive)
        outputs = [output_of(core, item, job.text_in_logprobs) for item in job.items]
        span.set_attributes(_generation_usage(job, outputs))
    telemetry.mirror(tracer("millstream.engine"), span)  # in each served group's own trace
    # Plain JSON types already: as a JSONResponse they skip FastAPI's walk of every value
    # through its encoder (0.65 ms of a 128-answer batch request, measured on the engine).
    return JSONResponse(outputs if job.as_list else outputs[0])


def _generation_span(core: EngineCore, job: Job) -> tuple[str, dict[str, Any]]:
    """Name and attributes of a generation's span, as OpenTelemetry's GenAI conventions say."""
    model = core.config.served_model_name or Path(str(core.config.model_path)).name
    return f"text_completion {model}", {
        STAGE: "engine",
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "millstream",
        "gen_ai.request.model": model,
        "gen_ai.usage.input_tokens": sum(len(s.prompt_ids) for s in job.seqs),
        "millstream.sequences": len(job.items),
    }


def _generation_usage(job: Job, outputs: list[dict[str, Any]] | None) -> dict[str, Any]:
    usage: dict[str, Any] = {"gen_ai.usage.output_tokens": sum(len(s.output_ids) for s in job.seqs)}
    if outputs is not None:
        reasons = [o["meta_info"]["finish_reason"] for o in outputs]
        usage["gen_ai.response.finish_reasons"] = [
            str(r.get("type") if isinstance(r, dict) else r) for r in reasons
        ]
    return usage


async def _traced_stream(
    core: EngineCore, job: Job, span_ctx: Any, served: dict[str, Any], links: list[Any]
) -> AsyncIterator[str]:
    # A manual span: a "current" span would attach a context in one task and detach it in
    # another, since the response body is iterated outside this handler.
    name, attributes = _generation_span(core, job)
    span = tracer("millstream.engine").start_span(
        name,
        context=span_ctx,
        attributes={**attributes, **served, "millstream.stream": True},
        links=links,
    )
    try:
        async for chunk in stream_outputs(core, job):
            yield chunk
    finally:
        span.set_attributes(_generation_usage(job, None))
        span.end()
        telemetry.mirror(tracer("millstream.engine"), span)


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """A one-token generation; 200 at once while paused (a paused engine is not broken)."""
    core = core_of(request)
    if core.scheduler.paused:
        return Response(status_code=200)
    req = GenerateReqIn(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    job = job_from_generate(core, req)
    submit(core, job)
    try:
        await aio.wait_for(wait_done(core, job), timeout=20)
    except TimeoutError:
        core.scheduler.abort(job.seqs[0].rid)
        return error_response("health_generate: no token within 20 s", status=503)
    return Response(status_code=200)


# SGLang's current names are /model_info and /server_info; the /get_* ones are still served.
@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    core = core_of(request)
    return {
        "model_path": core.runner.model_path,
        "tokenizer_path": core.runner.model_path,
        "served_model_name": core.config.model_name,
        "is_generation": True,
        "weight_version": core.weight_version,
        "context_length": core.scheduler.context_length,
        "vocab_size": core.runner.vocab_size,
        "eos_token_ids": sorted(core.runner.eos_token_ids),
        "dtype": core.config.dtype,
        "quantization": core.runner.quantization,
    }


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    core = core_of(request)
    config = {k: v for k, v in vars(core.config).items() if k != "admin_token"}
    state = core.scheduler.info()
    return {
        **config,
        # SGLang's server_args name: "fp8" for an FP8 checkpoint (engine/quant/fp8.py), else None;
        # and how its Linears compute, --fp8-gemm resolved.
        "quantization": core.runner.quantization,
        "fp8_gemm": core.runner.fp8_gemm,
        "version": "millstream-engine",
        # SGLang's names: GPUs (ranks in a weight-update group) per engine; one here.
        "tp_size": 1,
        "dp_size": 1,
        "weight_version": core.weight_version,
        "weight_update_groups": core.groups.names,
        # Where this engine computes and how it takes weights: the trainer picks the weight
        # transport from it (same GPU: CUDA IPC; same machine: shared memory; else a group).
        "placement": core.placement,
        "weight_transports": ["distributed", "tensor", "disk"],
        "uptime_s": time.time() - core.started_at,
        "scheduler": state,
        "internal_states": [state],
    }


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": core_of(request).weight_version}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format (engine/prom.py); a probe path: no span (telemetry.py)."""
    return Response(render(request.app.state.metrics), media_type=CONTENT_TYPE)


def create_app(core: EngineCore) -> FastAPI:
    app = FastAPI(
        title="millstream engine",
        docs_url=None,
        redoc_url=None,
        telemetry=telemetry.fastapi_telemetry(),  # type: ignore[arg-type]
    )
    app.state.core = core
    app.state.metrics = engine_registry(core)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(err)
        return error_response(message, param=field)

    @app.exception_handler(RequestError)
    async def _bad_request(_: Request, err: RequestError) -> JSONResponse:
        return error_response(str(err))

    @app.exception_handler(Fenced)
    async def _fenced(_: Request, err: Fenced) -> JSONResponse:
        return error_response(str(err), status=409)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_: Request, err: Unauthorized) -> JSONResponse:
        response = error_response(str(err), status=401)
        response.headers["www-authenticate"] = "Bearer"
        return response

    app.add_middleware(JSONBodyMiddleware)
    app.add_middleware(  # outermost: no layer reads a body before it is counted
        BodyLimit,
        max_bytes=core.config.max_request_bytes,
        error_response=lambda status, message: error_response(message, status),
        flag="--max-request-bytes",
    )
    app.include_router(router)
    app.include_router(control_router)
    app.include_router(openai_router)
    return app
