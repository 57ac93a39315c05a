"""Control endpoints: abort, pause/continue, flush, memory release/resume, and the weight
updates (SGLang's API).

Every control call becomes a scheduler command that runs between two decode steps (see
scheduler.py), awaited without blocking the event loop. Blocking work — joining a process
group, receiving a broadcast, decoding or reading safetensors — runs in a worker thread
under `aio.wait_for(..., --weight-update-timeout)`, so a trainer that never shows up
yields `{"success": false, "message": "... timed out ..."}` instead of a hung request.
Weight endpoints answer `{"success": bool, "message": str}` with 200 or 400, as SGLang does.

Every endpoint here changes the engine's state, so every one needs `Authorization: Bearer
<admin token>` when the engine has one (--admin-token or MILLSTREAM_ADMIN_TOKEN; the same
scheme as the router's admin endpoints, common/auth.py): 401 otherwise, checked before the
request is validated or acted on. /generate, the OpenAI and the info endpoints (api.py) stay
open.
None of these endpoints imports code: tensors arrive as broadcasts, safetensors or JSON handles
to memory the trainer shares (CUDA IPC, shared memory: common/tensor_share.py), never pickles,
and no request names a module or function to load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from millstream.common import aio
from millstream.common.auth import refusal
from millstream.common.fencing import FENCE_HEADER
from millstream.common.tensor_share import Mappings, open_bucket

from ..core import EngineCore
from ..scheduler import RequestError
from ..weights import decode_tensor_blobs, read_safetensors_dir
from .protocol import (
    FLATTENED_BUCKET,
    AbortReqIn,
    ContinueGenerationReqIn,
    DestroyWeightsUpdateGroupReqIn,
    FlushCacheReqIn,
    InitWeightsUpdateGroupReqIn,
    MemoryOccupationReqIn,
    PauseGenerationReqIn,
    UpdateWeightFromDiskReqIn,
    UpdateWeightsFromDistributedReqIn,
    UpdateWeightsFromTensorReqIn,
)

log = logging.getLogger(__name__)


class Unauthorized(Exception):
    """An admin call without the engine's admin token: a 401 (api.py renders it)."""


class Fenced(Exception):
    """An admin call from a run's older trainer (common/fencing.py): a 409 (api.py)."""


def _core(request: Request) -> EngineCore:
    return request.app.state.core


async def _check_token(request: Request) -> None:
    """Every admin endpoint: the admin token, then the caller's fencing number."""
    core = _core(request)
    if why := refusal(request.headers.get("authorization"), core.config.admin_token):
        raise Unauthorized(why)
    if why := core.fences.refusal(request.headers.get(FENCE_HEADER)):
        log.warning("refused %s %s: %s", request.method, request.url.path, why)
        raise Fenced(why)


router = APIRouter(dependencies=[Depends(_check_token)])


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    body = {"success": success, "message": message, **extra}
    return JSONResponse(body, status_code=200 if success else 400)


async def _in_thread(core: EngineCore, what: str, fn: Callable[[], Any]) -> Any:
    timeout = core.config.weight_update_timeout
    try:
        return await aio.wait_for(asyncio.to_thread(fn), timeout)
    except TimeoutError as err:
        raise RequestError(
            f"{what} timed out after {timeout:g} s (--weight-update-timeout); is the "
            "trainer side (rank 0) running the same step?"
        ) from err


async def _weights_call(what: str, work: Callable[[], Any]) -> JSONResponse:
    """Run a weight endpoint's body; failures become success=false with the reason."""
    try:
        message = await work()
    except RequestError as err:
        log.warning("%s failed: %s", what, err)
        return _result(False, f"{what}: {err}")
    except Exception as err:  # gloo/NCCL errors: report them, keep serving
        log.exception("%s failed", what)
        return _result(False, f"{what}: {type(err).__name__}: {err}")
    return _result(True, message)


@router.post("/abort_request")
async def abort_request(req: AbortReqIn, request: Request) -> dict[str, Any]:
    if not req.abort_all and not req.rid:
        raise RequestError("rid: give a request id, or abort_all: true")
    future = _core(request).scheduler.abort(req.rid or None, abort_all=req.abort_all)
    return {"success": True, "num_aborted": await asyncio.wrap_future(future)}


@router.post("/pause_generation")
async def pause_generation(req: PauseGenerationReqIn, request: Request) -> dict[str, Any]:
    count = await asyncio.wrap_future(_core(request).scheduler.pause(req.mode))
    return {
        "success": True,
        "status": "ok",
        "message": f"Generation paused (mode {req.mode}).",
        "num_paused_requests": count,
    }


@router.post("/continue_generation")
async def continue_generation(
    request: Request, req: ContinueGenerationReqIn | None = None
) -> dict[str, Any]:
    await asyncio.wrap_future(_core(request).scheduler.resume())
    return {"success": True, "status": "ok", "message": "Generation continued."}


@router.post("/release_memory_occupation")
async def release_memory_occupation(
    request: Request, req: MemoryOccupationReqIn | None = None
) -> dict[str, Any]:
    """Free memory for a trainer on the same GPU (--colocate), by SGLang's tags (`weights`,
    `kv_cache`, `cuda_graph`; none: all): running requests are retracted and wait, with every
    new one, for /resume_memory_occupation. The weights are discarded, not copied anywhere:
    after their resume no step runs until weight updates have written every parameter
    (scheduler.py, executor/model_runner.py). `bytes`: what each tag freed."""
    tags = req.tags if req is not None else None
    freed = await asyncio.wrap_future(_core(request).scheduler.release_memory(tags))
    return {"success": True, "message": f"released {sorted(freed)}", "bytes": freed}


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(
    request: Request, req: MemoryOccupationReqIn | None = None
) -> dict[str, Any]:
    tags = req.tags if req is not None else None
    allocated = await asyncio.wrap_future(_core(request).scheduler.resume_memory(tags))
    return {"success": True, "message": f"resumed {sorted(allocated)}", "bytes": allocated}


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request, req: FlushCacheReqIn | None = None) -> dict[str, Any]:
    dropped = await asyncio.wrap_future(_core(request).scheduler.flush_cache())
    return {
        "success": True,
        "message": f"Cache flushed: {dropped} tokens of the prefix cache dropped.",
    }


@router.post("/init_weights_update_group")
async def init_weights_update_group(
    req: InitWeightsUpdateGroupReqIn, request: Request
) -> JSONResponse:
    core = _core(request)

    async def work() -> str:
        await _in_thread(
            core,
            "joining the update group",
            lambda: core.groups.init(
                req.master_address,
                req.master_port,
                req.rank_offset,
                req.world_size,
                req.group_name,
                req.backend,
            ),
        )
        return f"joined {req.group_name!r} as rank {req.rank_offset} of {req.world_size}"

    return await _weights_call("init_weights_update_group", work)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(
    req: DestroyWeightsUpdateGroupReqIn, request: Request
) -> JSONResponse:
    core = _core(request)

    async def work() -> str:
        await _in_thread(
            core, "leaving the update group", lambda: core.groups.destroy(req.group_name)
        )
        return f"left {req.group_name!r}"

    return await _weights_call("destroy_weights_update_group", work)


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(
    req: UpdateWeightsFromDistributedReqIn, request: Request
) -> JSONResponse:
    core = _core(request)

    async def work() -> str:
        core.loader.check_specs(req.names, req.shapes)
        tensors = await _in_thread(
            core,
            f"receiving {len(req.names)} tensors",
            lambda: core.groups.receive(
                req.group_name,
                req.names,
                req.dtypes,
                req.shapes,
                flattened=req.load_format == FLATTENED_BUCKET,
            ),
        )
        await core.apply_weights(tensors, req.weight_version, req.abort_all_requests)
        return f"updated {len(tensors)} tensors; weight_version {core.weight_version}"

    return await _weights_call("update_weights_from_distributed", work)


def _open_shared(entry: str, mappings: Mappings) -> Any:
    try:
        return open_bucket(entry, mappings)
    except (OSError, ValueError, KeyError, RuntimeError) as err:  # not shared with this process
        raise RequestError(
            f"opening the shared bucket failed: {type(err).__name__}: {err}"
        ) from err


@router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(
    req: UpdateWeightsFromTensorReqIn, request: Request
) -> JSONResponse:
    core = _core(request)

    async def work() -> str:
        if req.load_format == FLATTENED_BUCKET:  # a bucket the trainer shares: no copy over HTTP
            tensors = await _in_thread(
                core,
                "opening the shared bucket",
                lambda: _open_shared(req.serialized_named_tensors[0], core.mappings),
            )
        else:
            tensors = await _in_thread(
                core, "decoding tensors", lambda: decode_tensor_blobs(req.serialized_named_tensors)
            )
        n, cuda = len(tensors), any(t.is_cuda for _, t in tensors)
        try:
            await core.apply_weights(tensors, req.weight_version, req.abort_all_requests)
        finally:
            del tensors  # the producer's memory: let go of it once copied in
            if cuda:
                torch.cuda.ipc_collect()
        return f"updated {n} tensors; weight_version {core.weight_version}"

    return await _weights_call("update_weights_from_tensor", work)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    req: UpdateWeightFromDiskReqIn, request: Request
) -> JSONResponse:
    core = _core(request)

    async def work() -> str:
        tensors = await _in_thread(
            core, f"reading {req.model_path}", lambda: read_safetensors_dir(req.model_path)
        )
        await core.apply_weights(tensors, req.weight_version, req.abort_all_requests)
        return f"loaded {len(tensors)} tensors from {req.model_path}; weight_version {core.weight_version}"

    return await _weights_call("update_weights_from_disk", work)
