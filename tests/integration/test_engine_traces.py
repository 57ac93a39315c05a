"""The engine's span of a request that serves several prompt groups (X-Millstream-Groups,
common/telemetry.py) in every group's own trace: the span itself in the trace its W3C parent
names, a copy (`telemetry.mirror`) under each other group's span, for a streamed /generate
as for a plain one. A real engine process writing its spans under --run-dir."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from millstream.tools.trace_cli import Span, read_mirrors, read_spans
from tests.support.engine_proc import EngineProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _groups(first: int) -> list[tuple[str, str, str]]:
    """Three groups, each (id, trace id, span id) of its rollout span, a trace of its own."""
    return [(f"g{first + i}", f"{first + i + 1:032x}", f"{first + i + 1:016x}") for i in range(3)]


def _headers(groups: list[tuple[str, str, str]]) -> dict[str, str]:
    (_, trace_id, span_id) = groups[0]  # W3C context names one parent: the first group's
    return {
        "traceparent": f"00-{trace_id}-{span_id}-01",
        "x-millstream-groups": ",".join(f"{g}@{t}-{s}" for g, t, s in groups),
    }


def test_the_engine_span_of_a_streamed_or_plain_request_lands_in_every_groups_trace(
    tiny_model_dir: Path, tmp_path: Path
):
    run_dir = tmp_path / "run"
    engine = EngineProcess(tiny_model_dir, tmp_path, "--run-dir", str(run_dir))
    streamed, plain = _groups(0), _groups(10)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
    try:
        with (
            httpx.Client(base_url=engine.url, timeout=30) as client,
            client.stream(
                "POST", "/generate", json={**body, "stream": True}, headers=_headers(streamed)
            ) as resp,
        ):
            assert resp.status_code == 200, engine.log_tail()
            assert "data: [DONE]" in "".join(resp.iter_text())
            resp = client.post("/generate", json=body, headers=_headers(plain))
            assert resp.status_code == 200, engine.log_tail()
    finally:
        assert engine.stop() == 0, engine.log_tail()  # its spans written out at exit

    spans, _ = read_spans(run_dir)
    copies = read_mirrors(run_dir)
    for groups, stream in ((streamed, True), (plain, False)):
        (_, trace_id, span_id) = groups[0]
        found: list[Span] = [
            s
            for s in spans
            if s.service == "engine" and s.stage == "engine" and s.trace_id == trace_id
        ]
        assert len(found) == 1, spans
        span = found[0]
        assert span.parent == span_id and span.attrs.get("millstream.stream", False) == stream
        assert span.attrs["millstream.group_ids"] == [g for g, _, _ in groups]
        for gid, other_trace, other_span in groups[1:]:
            mirrored = [
                (c.name, c.stage, c.parent)
                for c in copies.get(other_trace, ())
                if c.mirror_of == span.span_id
            ]
            assert mirrored == [(span.name, "engine", other_span)], (gid, stream, copies)
