"""The lowest transformers millstream claims (pyproject.toml: >= 5.17, what the GPU image carries)
runs the engine and the trainer's backend, not only the version CI pins (5.24): the engine leans
on transformers' cache internals (`Cache` built from layers, `CacheLayerMixin`, a mask mapping,
the `cache` / `past_key_values` keyword), which move between releases. scripts/bootstrap.sh puts
that release in .venv/floor; the engine's and the torch backend's tests that go through
transformers (TESTS) run in a child whose imports find it first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
FLOOR = REPO_ROOT / ".venv" / "floor"
# What the floor can change: the engine's forward through transformers' cache (prefill,
# decode into the pool, mixed lengths, other decoders, the graph path), the scheduler's
# log-probs against a full forward, and the backend's forward, gradient and save/load through
# transformers' model classes; the rest of those files tests millstream's own bookkeeping.
POOL = "tests/unit/engine/kv/test_token_pool.py::"
SCHED = "tests/unit/engine/test_engine_scheduler.py::"
BACKEND = "tests/unit/trainer/backends/test_torch_backend.py::"
TESTS = [
    POOL + "test_a_row_decodes_into_its_own_pages_and_the_first_copy_into_the_prompts_last",
    POOL + "test_a_long_prompt_beside_short_ones_is_served_and_each_reads_its_own_length",
    POOL + "test_the_graph_path_decodes_as_eager_on_the_cpu",
    POOL + "test_other_decoders_attend_over_the_pool_too",
    SCHED + "test_logprobs_equal_full_forward_with_requests_joining_mid_batch",
    SCHED + "test_a_burst_of_mixed_lengths_and_copies_is_prefilled_in_one_forward",
    BACKEND + "test_logprobs_equal_a_direct_forward",
    BACKEND + "test_micro_batches_give_the_whole_batch_gradient",
    BACKEND + "test_checkpoint_round_trip",
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
