"""The live tier: millstream against a real SGLang server, on the CPU.

`make test` runs this folder last, in a pytest of its own, with MILLSTREAM_SGLANG_LIVE=1 and
$MILLSTREAM_SGLANG_PYTHON naming the Python of SGLang's own venv (scripts/bootstrap_sglang.sh:
SGLang 0.5.23 with its dependencies, installed once per machine); the main run leaves the
folder out (tests/conftest.py). Where that venv could not be installed every test here skips,
saying why, in the summary (-rs) and at the top of the run.

One SGLang server serves the whole run (`sglang`, session scope: it takes 25 s to several
minutes to start on 2 cores), with millstream's router in front of it (`routed`); each test
that changes its weights leaves them to the next run's first sync (a trainer syncs an engine
at another version before its first rollout). The server's start is the launcher's command
line for a Miles launch script's SGLANG_ARGS (server.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sglang_live.server import ARITH_MODEL, LiveSglang, sglang_python
from tests.support.router_proc import start_router

NO_SERVER = (
    "sglang live tier: no SGLang venv ($MILLSTREAM_SGLANG_PYTHON unset; "
    "scripts/bootstrap_sglang.sh installs it and make test sets it): {why}"
)


def pytest_report_header(config: pytest.Config) -> str:
    python = sglang_python()
    if python is None:
        return "sglang live tier: SKIPPED, " + NO_SERVER.format(why=_why())
    return f"sglang live tier: SGLang from {python}"


def _why() -> str:
    log = Path(__file__).resolve().parents[2] / ".venv" / "sglang-live.log"
    tail = log.read_text(errors="replace").strip().splitlines()[-2:] if log.is_file() else []
    return " | ".join(tail) or "see scripts/bootstrap_sglang.sh"


@pytest.fixture(scope="session")
def live_python() -> str:
    python = sglang_python()
    if python is None:
        pytest.skip(NO_SERVER.format(why=_why()))
    return python


@pytest.fixture(scope="session")
def sglang(live_python: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSglang]:
    """The run's SGLang server on the arith model."""
    server = LiveSglang(ARITH_MODEL, tmp_path_factory.mktemp("sglang")).start()
    print(f"\n[sglang live] server up in {server.started_s[-1]:.1f} s: {server.url}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def routed(sglang: LiveSglang, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """millstream's router in front of the server: its URL."""
    router = start_router(tmp_path_factory.mktemp("router"), "--worker-urls", sglang.url)
    yield router.url
    router.stop()


@pytest.fixture
def alive(sglang: LiveSglang) -> Iterator[LiveSglang]:
    """The server, started again after a test that leaves it dead (the fault tests)."""
    yield sglang
    if not sglang.alive():
        sglang.start()
