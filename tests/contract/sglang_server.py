"""A stand-in for an SGLang server's HTTP surface whose judge is SGLang's own code.

What every body millstream sends an SGLang server must pass, and how the stand-in checks it:

  admin path   the class SGLang's http_server.py validates the body into, read from that
               file's source (`sglang_routes`: an SGLang upgrade that moves a route to another
               class moves the check with it), validated as FastAPI validates
               `Annotated[cls, Body()]` (pydantic, through SGLang's own
               `msgspec_struct_pydantic_core_schema`), PLUS no field that is not one of the
               class's: SGLang's schema ignores unknown fields, so a misspelt or unsupported
               field would be dropped silently there (`admin_problems`);
  /generate    in-process, test_generate_bodies.py `generate_problems`.

The server (`build_app`, run as `python -m tests.contract.sglang_server --port P` under the
contract tier's path) answers the admin paths with SGLang's routes' signatures, so FastAPI
itself validates each body into SGLang's class, refuses unknown fields on top (400), records
every request (`GET /_recorded`, `POST /_reset`) and answers with the shape SGLang's route
returns. The weight-update group is SGLang's own: `WeightUpdater` (model_runner_components),
whose `init_weights_update_group` joins through `init_custom_process_group` and whose
`receive_weights_from_distributed` receives a bucket as SGLang's model runner does (a
`FlattenedTensorBucket` and one broadcast, or one broadcast per tensor); the stand-in records
a sha256 per received tensor instead of loading it. `/update_weights_from_disk` records the
safetensors it finds. As SGLang 0.5.23, it has no `/get_weight_version` (the version is in
`/model_info`), and as its scheduler it refuses `/update_weights_from_distributed` outside a
weight-update session (`/begin_weight_update` .. `/end_weight_update`).

No `from __future__ import annotations` here: FastAPI reads each route's body annotation,
built at run time from SGLang's class.
"""

import argparse
import ast
import asyncio
import dataclasses
import functools
import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx

ROOT = Path(__file__).resolve().parents[2]

# The admin paths the trainer and the router send to an engine (docs/weight-sync.md), and the
# weight-update session SGLang 0.5.23 puts around distributed and tensor updates.
ADMIN_PATHS = (
    "/init_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_tensor", "/update_weights_from_disk", "/pause_generation",
    "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation",
    "/flush_cache", "/destroy_weights_update_group",
)  # fmt: skip
SESSION_PATHS = ("/begin_weight_update", "/end_weight_update")


# -- the checks ----------------------------------------------------------------------------


@functools.cache
def sglang_routes() -> dict[str, str | None]:
    """path -> the name of the class SGLang's http_server.py validates the route's body into
    (None: the route takes no body), read from the source: the module itself does not import
    without SGLang's GPU dependencies."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    source = Path(spec.submodule_search_locations[0]) / "srt/entrypoints/http_server.py"
    routes: dict[str, str | None] = {}
    for node in ast.walk(ast.parse(source.read_text())):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = [
            d.args[0].value
            for d in node.decorator_list
            if isinstance(d, ast.Call)
            and isinstance(d.func, ast.Attribute)
            and d.func.attr in ("post", "get", "api_route")
            and d.args
            and isinstance(d.args[0], ast.Constant)
        ]
        body = next(filter(None, (_body_class(a.annotation) for a in node.args.args)), None)
        routes |= {path: body for path in paths}
    return routes


def _body_class(annotation: ast.expr | None) -> str | None:
    """`Annotated[X, Body()]` or `Annotated[Optional[X], Body()]` -> "X"; a bare request class
    (`obj: GenerateReqInput`, a dataclass FastAPI takes as the body) -> its name."""
    if isinstance(annotation, ast.Name) and annotation.id.endswith("ReqInput"):
        return annotation.id
    if isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "Annotated":
        inner = annotation.slice.elts[0]  # type: ignore[attr-defined]
        if isinstance(inner, ast.Subscript):  # Optional[X]
            inner = inner.slice
        return inner.id if isinstance(inner, ast.Name) else None
    return None


def body_class(path: str) -> type | None:
    from sglang.srt.managers import io_struct

    name = sglang_routes()[path]
    return None if name is None else getattr(io_struct, name)


def field_names(cls: type) -> set[str]:
    import msgspec

    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {f.name for f in msgspec.structs.fields(cls)}


def unknown_fields(cls: type, body: dict[str, Any]) -> list[str]:
    return sorted(set(body) - field_names(cls))


def validation_problems(err: Any) -> list[str]:
    """pydantic's errors as `field: message`, without the branch SGLang's schema tries first
    (an instance of the class, which a JSON body never is) or the validators' names."""
    problems = []
    for e in err.errors():
        loc = [str(part) for part in e["loc"] if part != "body"]
        if any(part.startswith("is-instance[") for part in loc):
            continue
        problems.append(f"{'.'.join(p for p in loc if '[' not in p) or '(body)'}: {e['msg']}")
    return problems


def admin_problems(path: str, body: Any) -> list[str]:
    """Why SGLang's route for `path` would refuse `body` (or silently drop part of it); []
    when it takes it whole."""
    import pydantic

    cls = body_class(path)
    if cls is None:
        return [] if not body else [f"{path} takes no body; SGLang ignores {sorted(body)}"]
    try:
        pydantic.TypeAdapter(cls).validate_python(body)
    except pydantic.ValidationError as err:
        return validation_problems(err)
    unknown = unknown_fields(cls, body)
    return [f"unknown field(s) {unknown}: SGLang's {cls.__name__} drops them"] if unknown else []


def digest(tensor: Any) -> list[Any]:
    """[dtype, shape, sha256 of the bytes]: what arrived, comparable across processes."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    sha = hashlib.sha256(data).hexdigest()
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), sha]


# -- the server ----------------------------------------------------------------------------


class StandIn:
    """What the routes share: the record, the weight version, the session, SGLang's updater."""

    def __init__(self) -> None:
        self.recorded: list[dict[str, Any]] = []
        self.weight_version = "default"  # SGLang's --weight-version default
        self.session = False
        self.updater = _weight_updater()

    def record(self, path: str, body: Any, problems: list[str], status: int, **notes: Any):
        self.recorded.append(
            {"path": path, "body": body, "problems": problems, "status": status, **notes}
        )


def _weight_updater() -> Any:
    import torch
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    if not torch.distributed.is_initialized():
        # SGLang asserts an engine's own default group (its TP group) before it joins an
        # update group: here one of its own, rank 0 of 1.
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)

    def no_model(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the stand-in receives weights but loads no model")

    return WeightUpdater(
        tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
        get_model=no_model, update_model_fields=no_model, recapture_cuda_graph=no_model,
        get_model_runner=no_model,
    )  # fmt: skip


Outcome = tuple[int, Any, dict[str, Any]]  # HTTP status, JSON answer, notes for the record


def _done(success: bool, message: str, **notes: Any) -> Outcome:
    return (200 if success else 400), {"success": success, "message": message}, notes


async def _init_group(s: StandIn, obj: Any) -> Outcome:
    args = (obj.master_address, obj.master_port, obj.rank_offset, obj.world_size)
    ok, message = await asyncio.to_thread(
        s.updater.init_weights_update_group, *args, obj.group_name, obj.backend
    )
    return _done(ok, message)


async def _destroy_group(s: StandIn, obj: Any) -> Outcome:
    ok, message = await asyncio.to_thread(s.updater.destroy_weights_update_group, obj.group_name)
    return _done(ok, message)


async def _distributed(s: StandIn, obj: Any) -> Outcome:
    notes = {"in_session": s.session}
    if not s.session:  # SGLang's scheduler (managers/scheduler_components/weight_updater.py)
        return _done(False, "update_weights_from_distributed must run between "
                     "begin_weight_update() and end_weight_update()", **notes)  # fmt: skip
    try:  # as SGLang's scheduler: a failed receive is the answer's message
        weights = await asyncio.to_thread(
            s.updater.receive_weights_from_distributed,
            names=obj.names, dtypes=obj.dtypes, shapes=obj.shapes,
            group_name=obj.group_name, load_format=obj.load_format,
        )  # fmt: skip
    except Exception as err:
        return _done(False, f"Failed to receive weights: {err}", **notes)
    notes["received"] = {name: digest(tensor) for name, tensor in weights}
    return _done(True, "Succeeded to update parameter online." + _version(s, obj), **notes)


async def _disk(s: StandIn, obj: Any) -> Outcome:
    from safetensors.torch import load_file

    files = sorted(Path(obj.model_path).glob("*.safetensors"))
    if not files:
        status, content, notes = _done(False, f"Failed to get weights iterator: {obj.model_path}")
        return status, content | {"num_paused_requests": 0}, notes
    received = {n: digest(t) for f in files for n, t in load_file(f).items()}
    content = {"success": True, "message": "Succeeded to update model weights." + _version(s, obj)}
    return 200, content | {"num_paused_requests": 0}, {"received": received}


def _version(s: StandIn, obj: Any) -> str:
    if obj.weight_version is None:
        return ""
    s.weight_version = obj.weight_version
    return f" Weight version updated to {obj.weight_version}."


async def _session(s: StandIn, obj: Any, *, opening: bool) -> Outcome:
    if s.session == opening:  # SGLang's scheduler's messages
        if opening:
            return _done(False, "a weight-update session is already open; call "
                         "end_weight_update() first")  # fmt: skip
        return _done(False, "no weight-update session is open; call begin_weight_update() first")
    s.session = opening
    return _done(True, "Success")


async def _answer(content: Any, status: int = 200) -> Outcome:
    return status, content, {}


def _paused(message: str) -> dict[str, str]:
    return {"message": f"Generation {message} successfully.", "status": "ok"}


ACTIONS = {
    "/init_weights_update_group": _init_group,
    "/destroy_weights_update_group": _destroy_group,
    "/update_weights_from_distributed": _distributed,
    # checked, never opened: the stand-in never unpickles (test_tensor_route.py decodes it)
    "/update_weights_from_tensor": lambda s, o: _answer(
        {"success": False, "message": "not opened here"}, 400
    ),
    "/update_weights_from_disk": _disk,
    "/pause_generation": lambda s, o: _answer(_paused("paused")),
    "/continue_generation": lambda s, o: _answer(_paused("continued")),
    # SGLang's release/resume routes return None: `null`, 200
    "/release_memory_occupation": lambda s, o: _answer(None),
    "/resume_memory_occupation": lambda s, o: _answer(None),
    "/begin_weight_update": lambda s, o: _session(s, o, opening=True),
    "/end_weight_update": lambda s, o: _session(s, o, opening=False),
}


def build_app(state: StandIn) -> Any:
    import inspect

    from fastapi import Body, FastAPI, Query, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()

    async def json_of(request: Request) -> Any:
        raw = await request.body()
        try:
            return await request.json() if raw else None
        except ValueError:
            return raw.decode(errors="replace")

    @app.exception_handler(RequestValidationError)
    async def refused(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = validation_problems(exc)
        state.record(request.url.path, await json_of(request), problems, 422)
        return JSONResponse({"detail": problems}, 422)

    def route(path: str, cls: type) -> None:
        action = ACTIONS[path]

        async def endpoint(obj: Any, request: Request) -> JSONResponse:
            body = await json_of(request)
            unknown = unknown_fields(cls, body or {})
            if unknown:
                problems = [f"unknown field(s) {unknown}: SGLang's {cls.__name__} drops them"]
                state.record(path, body, problems, 400)
                return JSONResponse({"success": False, "message": problems[0]}, 400)
            status, content, notes = await action(state, obj)
            state.record(path, body, [], status, **notes)
            return JSONResponse(content, status)

        # The body parameter exactly as SGLang's route declares it.
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [
                inspect.Parameter("obj", kind, annotation=Annotated[cls, Body()]),
                inspect.Parameter("request", kind, annotation=Request),
            ]
        )
        app.add_api_route(path, endpoint, methods=["POST"])

    for path in (*ADMIN_PATHS, *SESSION_PATHS):
        cls = body_class(path)
        if cls is not None:
            route(path, cls)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request, timeout: float = Query(0.0, ge=0.0)) -> Response:
        state.record("/flush_cache", await json_of(request), [], 200, query={"timeout": timeout})
        return Response("Cache flushed.\nPlease check backend logs for more details.\n", 200)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "stand-in", "is_generation": True,
                "weight_version": state.weight_version}  # fmt: skip

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {"tp_size": 1, "dp_size": 1, "weight_version": state.weight_version}

    @app.get("/_recorded")
    async def recorded() -> list[dict[str, Any]]:
        return state.recorded

    @app.post("/_reset")
    async def reset() -> dict[str, Any]:
        state.recorded.clear()
        return {}

    return app


# -- the process ---------------------------------------------------------------------------


class StandInProcess:
    """The stand-in as a process of its own (a weight-update group needs two processes: torch
    keeps one registry of group names per process); its log in `workdir`."""

    def __init__(self, workdir: Path, timeout_s: float = 180.0):
        from tests.support.redis_server import free_port

        self.port = free_port()
        self.log_path = workdir / f"sglang-standin-{self.port}.log"
        self._log = self.log_path.open("w")
        argv = [sys.executable, "-m", "tests.contract.sglang_server", "--port", str(self.port)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MILLSTREAM_CONTRACT": "1"}
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the SGLang stand-in did not start:\n{self.log_tail()}")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def recorded(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/_recorded", timeout=10.0).json()

    def reset(self) -> None:
        httpx.post(self.url + "/_reset", timeout=10.0).raise_for_status()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    import uvicorn

    from tests.support import sglang_contract

    # SGLang's modules as the contract tier's pytest imports them (its torchvision stand-in).
    sglang_contract.load(
        "sglang.srt.managers.io_struct",
        "sglang.srt.model_executor.model_runner_components.weight_updater",
    )
    app = build_app(StandIn())
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    # Skip teardown: gloo can abort a process whose update group a peer still holds.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
