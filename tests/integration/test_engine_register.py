"""--register-with: the engine adds itself to a router on start and removes itself on SIGTERM;
and /generate continues the caller's trace (W3C traceparent) into the engine's spans."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from tests.support.engine_proc import EngineProcess
from tests.support.redis_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


class FakeRouter:
    """Records Miles-style add_worker/remove_worker calls and answers 200."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None]] = []
        calls = self.calls

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                parsed = urlparse(self.path)
                url = parse_qs(parsed.query).get("url", [""])[0]
                calls.append((parsed.path, url, self.headers.get("Authorization")))
                body = json.dumps({"success": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def router() -> Iterator[FakeRouter]:
    r = FakeRouter()
    yield r
    r.close()


def test_engine_registers_traces_and_unregisters_on_sigterm(
    router: FakeRouter, tiny_model_dir: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    engine = EngineProcess(
        tiny_model_dir,
        tmp_path,
        "--register-with",
        router.url,
        "--admin-token",
        "tok",
        "--run-dir",
        str(run_dir),
    )
    try:
        deadline = time.monotonic() + 20
        while not router.calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert router.calls == [("/add_worker", engine.url, "Bearer tok")], engine.log_tail()

        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"}
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        resp = httpx.post(f"{engine.url}/generate", json=body, headers=headers, timeout=30)
        assert resp.status_code == 200
    finally:
        code = engine.stop()
    assert code == 0, engine.log_tail()
    assert router.calls[-1] == ("/remove_worker", engine.url, "Bearer tok")

    spans = [
        json.loads(line)
        for file in (run_dir / "traces").glob("*.jsonl")
        for line in file.read_text().splitlines()
    ]
    generate = [s for s in spans if s["attributes"].get("millstream.stage") == "engine"]
    assert len(generate) == 1, spans
    assert generate[0]["name"] == f"text_completion {tiny_model_dir.name}"
    assert generate[0]["attributes"]["gen_ai.usage.output_tokens"] > 0
    assert generate[0]["trace_id"] == TRACE_ID
    assert generate[0]["parent_span_id"] == PARENT_SPAN
