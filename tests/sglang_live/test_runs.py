"""The arith job with a real SGLang server as its only engine, as a Miles user runs it.

Sync: `millstream train` starts the server itself, from SGLang's own venv
($MILLSTREAM_SGLANG_PYTHON) with the run's SGLANG_ARGS (the CPU flags, passed as --sglang-*),
registers it with the router it starts, and trains through it; the router admits it by
/health and serves only the version /model_info reports. Async: `millstream train-async`
against the session's server behind millstream's router (--router-url). Each runs beside the
same job on millstream's engine, same flags and rollouts: both learn, to the same band.

The band: greedy accuracy after ROLLOUTS rollouts at least START + GAIN on both (the model
starts at 31%), and the two within BAND of each other. Neither engine's sampling is seeded the
same way, so the curves differ by the noise of 64 x 8 samples a rollout; measured on 2 cores at
rollouts 0 / 5 / 10, sync: SGLang 0.31 / 0.585 / 0.635, millstream's engine 0.31 / 0.585 / 0.70;
async: SGLang 0.31 / 0.585 / 0.615, millstream's engine 0.31 / 0.53 / 0.62.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.sglang_live.arith import ArithRun, arith_run
from tests.sglang_live.server import CPU_SGLANG_ARGS

pytestmark = pytest.mark.timeout(900)

ROLLOUTS = 10
START, GAIN, BAND = 0.31, 0.15, 0.15
# The update group's route: an SGLang server does not say where it lives (gloo on the CPU).
ROUTE = ("--update-weight-transport", "nccl")


def _learned(sglang: ArithRun, ours: ArithRun) -> None:
    a, b = sglang.evals[ROLLOUTS], ours.evals[ROLLOUTS]
    print(f"\neval at {ROLLOUTS}: SGLang {sglang.evals}, millstream's engine {ours.evals}")
    assert a >= START + GAIN and b >= START + GAIN, (sglang.evals, ours.evals)
    assert abs(a - b) <= BAND, (sglang.evals, ours.evals)


def test_the_launcher_starts_sglang_from_its_own_python_and_the_sync_run_learns(
    live_python: str, tmp_path: Path
):
    flags = (*CPU_SGLANG_ARGS, *ROUTE)
    run = arith_run(tmp_path / "sglang", "train", ROLLOUTS, *flags, sglang_python=live_python)
    run.ok()
    started = (run.run_dir / "logs" / "engine-0.log").read_text(errors="replace")
    launched = re.search(
        r"by the millstream launcher: (\S+) -m sglang\.launch_server (.*)", started
    )
    assert launched, started[-3000:]
    assert launched.group(1) == live_python
    assert "--device cpu" in launched.group(
        2
    ) and "--attention-backend torch_native" in launched.group(2)
    # The router gated on SGLang's /model_info: each eval ran on the engine at that version.
    assert f"[trainer] eval at iter {ROLLOUTS} (version {ROLLOUTS}):" in run.out
    assert "weight transport to http://127.0.0.1:" in run.out and ": nccl (" in run.out

    ours = arith_run(tmp_path / "ours", "train", ROLLOUTS).ok()
    _learned(run, ours)


def test_the_async_run_learns_through_the_router(routed: str, sglang, tmp_path: Path):
    run = arith_run(tmp_path / "sglang", "train-async", ROLLOUTS, "--router-url", routed, *ROUTE)
    run.ok()
    assert sglang.version() == str(ROLLOUTS)  # the last sync's, as SGLang reports it
    ours = arith_run(tmp_path / "ours", "train-async", ROLLOUTS).ok()
    _learned(run, ours)
