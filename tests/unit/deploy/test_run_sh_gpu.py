"""examples/arith/run.sh decides --colocate --bf16 by asking `$MILLSTREAM gpus`, the torch the
trainer will import, whatever MILLSTREAM is (a venv's script, a wrapper, a command on PATH),
and prints its decision either way. The trainer is a recorder here: nothing trains."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "arith" / "run.sh"
RECORD = "printf '%s\\0' \"$@\""  # the trainer's command line on stdout, NUL-separated


def _millstream(tmp_path: Path, gpus: str) -> Path:
    """A `millstream` in a folder with no python beside it: `gpus` runs the shell `gpus`
    (and is logged in asked.log); every other command is recorded."""
    path = tmp_path / "bin" / "millstream"
    path.parent.mkdir()
    log = tmp_path / "asked.log"
    path.write_text(
        f'#!/bin/sh\nif [ "$1" = gpus ]; then echo gpus >> "{log}"; {gpus}; fi\n{RECORD}\n'
    )
    path.chmod(0o755)
    return path


def _run(millstream: Path, tmp_path: Path, *flags: str, **env: str):
    out = subprocess.run(
        ["bash", str(SCRIPT), *flags],
        env={**os.environ, "MILLSTREAM": str(millstream), "RUN_DIR": str(tmp_path / "run"),
             "MODE": "train", **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    command, *argv = out.stdout.split("\0")[:-1]
    assert command == "train"
    return argv, out.stderr


def test_a_wrapper_outside_any_venv_is_asked_and_the_cpu_run_is_said(tmp_path):
    """MILLSTREAM is a wrapper that runs `python -m millstream.cli`: there is no python beside
    it, which is where run.sh used to look, silently running neither --colocate nor --bf16."""
    wrapper = _millstream(tmp_path, f'exec "{sys.executable}" -m millstream.cli "$@"')
    argv, err = _run(wrapper, tmp_path, CUDA_VISIBLE_DEVICES="")
    assert f"[run.sh] no GPU visible to {wrapper}: CPU run" in err.splitlines()
    assert "--colocate" not in argv and "--bf16" not in argv
    assert (tmp_path / "asked.log").read_text() == "gpus\n"


def test_a_gpu_millstream_sees_makes_the_run_colocated_in_bf16(tmp_path):
    fake = _millstream(tmp_path, "echo 1; echo 'cuda:0 NVIDIA H100 80GB HBM3 8f0c-aaaa'; exit 0")
    argv, err = _run(fake, tmp_path)
    assert "--colocate" in argv and "--bf16" in argv
    assert (
        f"[run.sh] 1 GPU(s) visible to {fake}: --colocate --bf16 (COLOCATE=0 to run as written)"
        in err.splitlines()
    )


@pytest.mark.parametrize(
    ("flags", "env", "said"),
    [
        ((), {"COLOCATE": "0"}, "[run.sh] COLOCATE=0: the flags as written"),
        (("--router-url", "http://r:1"), {},
         "[run.sh] --router-url: the engines run elsewhere; the flags as written"),
        (("--router-url=http://r:1",), {},
         "[run.sh] --router-url: the engines run elsewhere; the flags as written"),
    ],
)  # fmt: skip
def test_as_written_runs_say_so_without_asking(tmp_path, flags, env, said):
    fake = _millstream(tmp_path, "echo 1; exit 0")
    argv, err = _run(fake, tmp_path, *flags, **env)
    assert said in err.splitlines()
    assert "--colocate" not in argv and not (tmp_path / "asked.log").exists()


def test_a_millstream_that_cannot_answer_gives_a_cpu_run_that_says_why(tmp_path):
    fake = _millstream(tmp_path, "echo 'no module named torch' >&2; exit 1")
    argv, err = _run(fake, tmp_path)
    assert "no module named torch" in err  # its own error, passed on
    assert f"[run.sh] '{fake} gpus' gave no GPU count (exit 1, first line ''): CPU run" in (
        err.splitlines()
    )
    assert "--colocate" not in argv


@pytest.mark.parametrize("flags", [(), ("--load", "CKPT"), ("--load=CKPT",)])
def test_a_run_told_to_resume_keeps_its_run_dir_and_a_fresh_one_starts_empty(tmp_path, flags):
    """A restarted trainer (`--load` among the extra flags) resumes from the checkpoints in
    RUN_DIR: run.sh used to delete them at every start (issue 42's chaos monkey). A fresh
    start gets an empty RUN_DIR, the earlier one moved aside (tests/unit/trainer/test_rerun.py)."""
    kept = tmp_path / "run" / "ckpt" / "latest_checkpointed_iteration.txt"
    kept.parent.mkdir(parents=True)
    kept.write_text("60")
    fake = _millstream(tmp_path, "echo 0; exit 0")
    _run(fake, tmp_path, *[f.replace("CKPT", str(kept.parent)) for f in flags], COLOCATE="0")
    assert kept.exists() == bool(flags)
    moved = list(tmp_path.glob("run.prev-*/ckpt/latest_checkpointed_iteration.txt"))
    assert len(moved) == (0 if flags else 1)
