"""The lowest transformers millstream claims (pyproject.toml: >= 5.17, what the GPU image carries)
runs the engine and the trainer's backend, not only the version CI pins (5.24): the engine leans
on transformers' cache internals (`Cache` built from layers, `CacheLayerMixin`, a mask mapping,
the `cache` / `past_key_values` keyword), which move between releases. scripts/bootstrap.sh puts
that release in .venv/floor; the engine's cache and scheduler tests and the torch backend's run
in a child whose imports find it first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FLOOR = REPO_ROOT / ".venv" / "floor"
TESTS = [
    "tests/unit/test_token_pool.py",
    "tests/unit/test_engine_scheduler.py",
    "tests/unit/test_torch_backend.py",
]


def test_the_claimed_floor_is_the_one_installed_for_this_test():
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    (low,) = re.findall(r'"transformers>=([0-9.]+),<6"', pyproject)
    assert (FLOOR / f"transformers-{low}.0.dist-info").is_dir(), (
        f"pyproject.toml claims transformers >= {low}: scripts/bootstrap.sh installs that one "
        f"in {FLOOR}"
    )


@pytest.mark.slow
def test_the_engine_and_the_backend_run_on_the_lowest_transformers(tmp_path):
    if not FLOOR.is_dir():
        pytest.fail(f"{FLOOR} missing: run scripts/bootstrap.sh (make test does)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FLOOR), str(REPO_ROOT)])}
    version = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert version.startswith("5.17"), version
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu",
         "--basetemp", str(tmp_path / "t"), *TESTS],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"on transformers {version}:\n{proc.stdout[-4000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout
