"""`millstream train` with SGLang installed starts `python -m sglang.launch_server` per engine
(launch/engines.py). Here SGLang is the stand-in package of tests/support/sglang_standin:
its launch_server has the pinned SGLang (.venv/sglang) parse and resolve the command line in
a child process, as the real server does before it serves, then runs millstream's engine with
the settings SGLang parsed: the command line, the registration with the router, the health
wait and every weight sync go through the code a real SGLang server gets. The trainer is told
`--update-weight-transport nccl`, the route a real SGLang server gets (it does not say where
it lives): gloo on the CPU. A flag SGLang refuses stops the run with SGLang's message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "arith" / "run.sh"
STANDIN = REPO / "tests" / "support" / "sglang_standin"


def _train(
    tmp_path: Path, num_rollout: int, *flags: str
) -> tuple[subprocess.CompletedProcess, Path]:
    """examples/arith/run.sh with the stand-in first on the path: the run, and the record of
    each engine's command line."""
    record = tmp_path / "sglang-argv.jsonl"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]),
        "SGLANG_STANDIN_RECORD": str(record),
        "MILLSTREAM": str(Path(sys.executable).with_name("millstream")),
        "RUN_DIR": str(tmp_path / "run"),
        "NUM_ROLLOUT": str(num_rollout),
        "MODE": "train",
        "COLOCATE": "0",
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=280
    )
    return proc, record


@pytest.mark.long  # a real SGLang server started by the launcher, learning: tests/sglang_live/test_runs.py
def test_the_arith_job_trains_on_engines_started_as_sglang_servers(tmp_path):
    # 64: the arith model's context (SGLang's resolution refuses a longer one)
    flags = ["--eval-interval", "3", "--update-weight-transport", "nccl",
             "--sglang-context-length", "64", "--sglang-random-seed", "5"]  # fmt: skip
    proc, record = _train(tmp_path, 3, *flags)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    (argv,) = [json.loads(line) for line in record.read_text().splitlines()]  # one engine
    assert argv[:2] == ["--model-path", str((REPO / "examples" / "arith" / "model").resolve())]
    pairs = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert pairs["--tp-size"] == "1" and pairs["--weight-version"] == "0"
    assert argv[argv.index("--device") + 1] == "cpu"  # the plan gave it no GPU
    assert argv[-4:] == ["--context-length", "64", "--random-seed", "5"]  # handed on, in order
    assert "GPU plan: no GPU here; trainer: CPU; engine-0: CPU" in out
    assert "weight transport to http://127.0.0.1:" in out and ": nccl (" in out

    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 3 and all(r["grad_norm"] > 0 for r in rows)
    # The router routes only to engines at the trainer's version: the eval after the third
    # sync ran on the SGLang-started engine holding version 3.
    assert "[trainer] eval at iter 3 (version 3):" in out


@pytest.mark.long  # SGLang's parser on every flag: tests/contract/test_server_args.py
def test_a_flag_sglang_refuses_stops_the_run_with_sglang_s_message(tmp_path):
    """A typo of one of SGLang's flags: millstream cannot know SGLang's flags, so it hands it
    on, and the server's start fails with argparse's message, which the launcher shows."""
    proc, record = _train(tmp_path, 1, "--sglang-context-lenght", "64")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert json.loads(record.read_text())[-2:] == ["--context-lenght", "64"]
    assert "engine-0 exited with code 2 while starting" in out, out[-4000:]
    assert "sglang serve: error: unrecognized arguments: --context-lenght 64" in out, out[-4000:]
