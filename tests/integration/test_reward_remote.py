"""`--rm-type remote_rm` against a real HTTP reward model on loopback: payload, number and dict
answers, and a reward model that is down or broken, which fails the group (never a 0)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from millstream.common.config import parse_run_config
from millstream.common.types import PromptGroup, Sample, SampleGroup, Verdict
from tests.support.redis_server import free_port
from tests.support.scoring import score_groups

pytestmark = pytest.mark.integration


class FakeRM(BaseHTTPRequestHandler):
    """Scores 1.0 when response == label; answers by label: "dict" -> {"reward", "acc"},
    "error" -> HTTP 500, else a bare number."""

    requests: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeRM.requests.append(body)
        right = float(body["response"] == body["label"])
        if body["label"] == "error":
            self._reply(500, b"verifier crashed")
        elif body["metadata"].get("as_dict"):
            self._reply(200, json.dumps({"reward": right, "acc": 0.25}).encode())
        else:
            self._reply(200, json.dumps(right).encode())

    def _reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def rm_url() -> Iterator[str]:
    FakeRM.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRM)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def score(url: str, groups: list[SampleGroup], *flags: str):
    cfg = parse_run_config(
        ["--run-id", "remote", "--rollout-batch-size", "1", "--rm-type", "remote_rm",
         "--rm-url", url, "--reward-timeout", "2", *flags],
        mode="async",
    )  # fmt: skip
    return score_groups(cfg, *groups)


def make_group(gid: str, responses: list[str], label: str, metadata: str = "") -> SampleGroup:
    return SampleGroup(
        prompt=PromptGroup(group_id=gid, prompt_text="capital of France?"),
        samples=[
            Sample(group_id=gid, index=i, response_text=r, label=label, metadata_json=metadata)
            for i, r in enumerate(responses)
        ],
    )


@pytest.mark.timeout(30)
def test_remote_rm_posts_the_sample_and_reads_numbers_and_dicts(rm_url):
    plain = make_group("plain", ["Paris", "Lyon"], "Paris", '{"source": "geo"}')
    as_dict = make_group("dict", ["Paris"], "Paris", '{"as_dict": true}')
    (a, b), _ = score(rm_url, [plain, as_dict])
    assert a.verdict == b.verdict == Verdict.VERDICT_KEPT
    assert [s.reward for s in a.group.samples] == [1.0, 0.0]
    assert [s.reward for s in b.group.samples] == [1.0]
    first = next(r for r in FakeRM.requests if r["response"] == "Lyon")
    assert first == {
        "prompt": "capital of France?",
        "response": "Lyon",
        "label": "Paris",
        "metadata": {"source": "geo"},
    }
    ([keyed], _) = score(rm_url, [as_dict], "--reward-key", "acc")
    assert [s.reward for s in keyed.group.samples] == [0.25]


@pytest.mark.timeout(30)
def test_remote_rm_errors_fail_the_group_and_the_next_group_is_scored(rm_url):
    broken = make_group("broken", ["x"], "error")
    fine = make_group("fine", ["Paris"], "Paris")
    (failed, kept), stats = score(rm_url, [broken, fine], "--reward-retries", "2")
    assert failed.verdict == Verdict.VERDICT_FAILED
    assert "sample 0" in failed.reason and "HTTP 500" in failed.reason
    assert "3 attempts" in failed.reason
    assert kept.verdict == Verdict.VERDICT_KEPT and [s.reward for s in kept.group.samples] == [1.0]
    assert stats["reward_retries"] == 2


@pytest.mark.timeout(30)
def test_remote_rm_that_is_down_fails_the_group_never_zero():
    down = f"http://127.0.0.1:{free_port()}/score"
    ([out], stats) = score(down, [make_group("down", ["Paris", "Lyon"], "Paris")])
    assert out.verdict == Verdict.VERDICT_FAILED
    assert "unreachable" in out.reason and down in out.reason
    assert stats["failed"] == 1 and stats["kept"] == 0
