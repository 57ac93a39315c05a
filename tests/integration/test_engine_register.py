"""--register-with, end to end with our router: the engine adds itself (`/add_worker`, with the
admin token the router asks for) on start, the router routes to it and the caller's trace (W3C
traceparent) goes on through the router into the engine's span, and on SIGTERM the engine
removes itself (`/remove_worker`) before it exits."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from millstream.tools.trace_cli import read_spans
from tests.support.engine_proc import EngineProcess
from tests.support.router_proc import start_router

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TOKEN = "tok"


def _listed(router_url: str) -> list[str]:
    return httpx.get(f"{router_url}/list_workers", timeout=5).json()["urls"]


def _wait_listed(router_url: str, expected: list[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _listed(router_url) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _listed(router_url) == expected


def test_engine_registers_serves_traces_and_unregisters_on_sigterm(
    tiny_model_dir: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    router = start_router(tmp_path, "--admin-token", TOKEN, "--run-dir", str(run_dir))
    try:
        assert _listed(router.url) == []
        engine = EngineProcess(tiny_model_dir, tmp_path, "--register-with", router.url,
                               "--admin-token", TOKEN, "--run-dir", str(run_dir))  # fmt: skip
        try:
            _wait_listed(router.url, [engine.url])
            headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"}
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
            deadline = time.monotonic() + 20  # routed once the router's health check passed
            while True:
                resp = httpx.post(f"{router.url}/generate", json=body, headers=headers, timeout=30)
                if resp.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert resp.status_code == 200, resp.text
            assert resp.json()["meta_info"]["completion_tokens"] > 0
        finally:
            code = engine.stop()
        assert code == 0, engine.log_tail()
        assert _listed(router.url) == [], "the engine did not remove itself on SIGTERM"
    finally:
        router.stop()

    spans, _ = read_spans(run_dir)
    generate = [s for s in spans if s.service == "engine" and s.stage == "engine"]
    assert len(generate) == 1, spans
    assert generate[0].name == f"text_completion {tiny_model_dir.name}"
    assert generate[0].attrs["gen_ai.usage.output_tokens"] > 0
    proxied = [s for s in spans if s.service == "router" and s.trace_id == TRACE_ID]
    assert proxied and generate[0].trace_id == TRACE_ID
    assert generate[0].parent in {s.span_id for s in proxied}  # the engine's parent: the router


def test_an_engine_without_the_routers_token_is_refused_at_once(
    tiny_model_dir: Path, tmp_path: Path
):
    """The router's admin endpoints refuse a registration without its token; a refused
    token is not tried again: the engine exits 1 at once, saying which token to give."""
    router = start_router(tmp_path, "--admin-token", TOKEN)
    try:
        try:
            engine = EngineProcess(tiny_model_dir, tmp_path, "--register-with", router.url)
        except RuntimeError as err:  # it exited before its health check was first answered
            said = str(err)
            assert "exited with 1" in said, said
        else:
            try:
                code = engine.proc.wait(timeout=20)  # it serves /health, then registers
            finally:
                engine.stop()
            said = engine.log_tail()
            assert code == 1, said
        assert "refused this engine's admin token" in said, said
        assert _listed(router.url) == []
    finally:
        router.stop()
