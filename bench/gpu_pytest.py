"""The tests stage of `make gpu-check`: which GPU-marked tests, in which order, and a pytest
plugin that reports each as it happens.

`gpu_test_ids()` lists every test that carries the gpu mark (on itself, its class or its
module) by node id, from the test files' source: no import and no collection, so the list
stands even when pytest never gets to collect. GPU-critical first, the patterns of ORDER in
turn (the token pool and its CUDA graphs, the engine's memory release, CUDA IPC, FP8), then
the rest in file order, then LAST (the Megatron test spawns its ranks: the slowest). The
stage passes them to pytest in that order; pytest collects node ids in the order given.

The plugin (`-p gpu_pytest`, with bench/ on PYTHONPATH):
- keeps that order: tests/conftest.py sorts make test's slowest files first (FIRST, with the
  Megatron file among them); this hook runs after it (trylast) and sorts the tests by the
  command-line argument each came from;
- writes one JSON line per event to $MILLSTREAM_GPU_TESTS_JSONL as it happens: `collected`
  (every node id, in the order they will run), `start` (a test begins), `report` (each phase
  of a test: setup, call, teardown, with its outcome, seconds and the failure's message).
  Each line is one write(2) to a file opened O_APPEND, in the kernel once written: a pytest
  killed by SIGKILL at the stage's limit keeps every line (a junit report is written only at
  the end, so a killed pytest leaves none). bench/gpu_rows.py makes the rows: every collected
  test without a report is "not reached".
"""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
JSONL = "MILLSTREAM_GPU_TESTS_JSONL"
ORDER = (
    "tests/unit/engine/kv/test_token_pool.py::",  # the token pool, the CUDA graphs' decoding
    "tests/unit/engine/test_engine_gpu.py::test_release",  # the engine's memory release
    "tests/unit/trainer/weights/test_cuda_ipc.py::",  # the colocated weight update's route
    "fp8",  # the FP8 GEMM on the device's torch
)
LAST = ("tests/integration/trainer/test_megatron_model.py::",)


def _marked(node: ast.AST) -> bool:
    return any("mark.gpu" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def _is_test(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")


def gpu_test_ids(contract: bool = False) -> list[str]:
    """Every GPU-marked test of tests/contract/ (contract) or of the other tiers, in ORDER."""
    found = []
    for path in sorted((REPO_ROOT / "tests").rglob("test_*.py")):
        if (path.parent.name == "contract") != contract or "sglang_live" in path.parts:
            continue  # the live SGLang tier runs beside its own server, never here
        tree = ast.parse(path.read_text())
        module = any(
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            and "mark.gpu" in ast.unparse(n.value)
            for n in tree.body
        )
        rel = path.relative_to(REPO_ROOT).as_posix()
        for node in tree.body:
            if _is_test(node) and (module or _marked(node)):
                found.append(f"{rel}::{node.name}")  # type: ignore[attr-defined]
            elif isinstance(node, ast.ClassDef):
                found += [
                    f"{rel}::{node.name}::{item.name}"  # type: ignore[attr-defined]
                    for item in node.body
                    if _is_test(item) and (module or _marked(node) or _marked(item))
                ]

    def rank(node_id: str) -> int:
        first = [i for i, pattern in enumerate(ORDER) if pattern in node_id]
        if first:
            return first[0]
        return len(ORDER) + (1 if any(p in node_id for p in LAST) else 0)

    return sorted(found, key=rank)  # stable: file order within a rank


def _write(event: dict) -> None:
    path = os.environ.get(JSONL)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(event) + "\n").encode())
        finally:
            os.close(fd)


def _from_argument(node_id: str, arguments: list[str]) -> int:
    """The position of the command-line argument `node_id` was collected from."""
    for i, arg in enumerate(arguments):
        arg = arg.rstrip("/")
        if node_id == arg or node_id.startswith((f"{arg}::", f"{arg}[", f"{arg}/")):
            return i
    return len(arguments)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _from_argument(item.nodeid, list(config.args)))


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"event": "collected", "ids": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid: str) -> None:
    _write({"event": "start", "id": nodeid, "t": time.time()})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)[-500:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    _write({"event": "report", "id": report.nodeid, "when": report.when,
            "outcome": report.outcome, "seconds": report.duration,
            "message": message.splitlines()[0][:300] if message else ""})  # fmt: skip
