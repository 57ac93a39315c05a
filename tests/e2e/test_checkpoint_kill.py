"""A real trainer SIGKILLed inside a checkpoint's write (trainer/checkpoints/atomic.py): the
checkpoint before it stays the latest, whole, and a restart with --load resumes from it, the
killed save's temp dir removed at its start. The pieces, and the kills between two renames:
tests/unit/trainer/checkpoints/test_checkpoint_atomic.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from millstream.trainer.checkpoints import checkpoint
from tests.support.tiny_job import job_flags, write_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# A save under way: today's temp dir (iter_N.saving-<holder>, not its .lock file) or the one
# shared name of old.
TEMP = re.compile(r"iter_(\d{7})\.(saving-.+(?<!\.lock)|tmp)")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl")


def _start(flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "millstream.cli", "train", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _kill_inside_a_save(trainer: subprocess.Popen, ckpt: Path, deadline_s: float) -> Path:
    """SIGKILL `trainer` while a save's temp dir exists, one that is not the run's first:
    each time one appears it is frozen (SIGSTOP) and looked at again; a save that has
    renamed it away since is let go on (SIGCONT) and the next one waited for."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert trainer.poll() is None, "the trainer ended before a save could be caught"
        names = os.listdir(ckpt) if ckpt.is_dir() else []
        if checkpoint.LATEST in names and any(TEMP.fullmatch(n) for n in names):
            trainer.send_signal(signal.SIGSTOP)
            temps = [ckpt / n for n in os.listdir(ckpt) if TEMP.fullmatch(n)]
            if temps:
                trainer.send_signal(signal.SIGKILL)
                trainer.wait(timeout=30)
                return temps[0]
            trainer.send_signal(signal.SIGCONT)
        time.sleep(0.0005 if checkpoint.LATEST in names else 0.05)  # closely once it saves
    raise AssertionError(f"no save caught in {deadline_s} s")


def test_a_trainer_killed_inside_a_save_resumes_from_the_checkpoint_before(
    tiny_model_dir, prompts, tmp_path
):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    flags = job_flags(
        tiny_model_dir, prompts, run_dir, "--num-rollout", "40", "--save", str(ckpt),
        run_id="ckpt-kill",
    )  # fmt: skip
    first = _start([*flags, "--save-interval", "1"])
    try:
        temp = _kill_inside_a_save(first, ckpt, deadline_s=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        first.stdout.close()  # type: ignore[union-attr]
    assert temp.exists()  # the kill landed inside the save: its temp dir is left
    latest = checkpoint.latest_iteration(ckpt)
    assert latest is not None and latest < int(TEMP.fullmatch(temp.name).group(1))  # type: ignore[union-attr]
    state = checkpoint.load_state(ckpt, latest)
    assert state["iteration"] == latest and (checkpoint.iter_dir(ckpt, latest) / "model").is_dir()

    # No saves in the resumed run until its end: whatever removes the temp dir is its start.
    resumed, lines = _start([*flags, "--save-interval", "100", "--load", str(ckpt)]), []
    try:
        for line in resumed.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith(f"[trainer] iter {latest + 1}/"):
                break
        out = "".join(lines)
        assert f"resumed at iteration {latest}" in out, out[-4000:]
        assert f"[trainer] checkpoints: removed {temp}" in out, out[-4000:]
        assert not [n for n in os.listdir(ckpt) if TEMP.fullmatch(n)], os.listdir(ckpt)
    finally:
        resumed.kill()
        resumed.wait()
        resumed.stdout.close()  # type: ignore[union-attr]
