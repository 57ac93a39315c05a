"""The chaos suite, short: every fault of `make chaos` once or twice, in seconds per scenario.

Real processes on loopback (redis-server with AOF, router, engines, workers, the trainer), the
tiny model; each test fails with the scenario's broken promises (lost groups, groups trained
twice, a worker that died, a reward of 0 for a broken reward function...).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import scenarios

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _ok(row: scenarios.Row) -> None:
    assert row.injected > 0, row
    assert row.ok, "\n".join(row.problems)


def test_workers_killed_and_restarted(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.workers_killed(tmp_path, tiny_model_dir, iterations=40, every_s=2.0))


def test_engine_killed_mid_generation(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.engine_killed(tmp_path, tiny_model_dir, iterations=150, kills=1))


def test_trainer_killed_mid_iteration_resumes(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.trainer_killed(tmp_path, tiny_model_dir, iterations=16, save_interval=6))


def test_redis_restarted(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.redis_restarted(tmp_path, tiny_model_dir, iterations=30, restarts=1))


def test_poison_entries_and_broken_rewards(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.poison(tmp_path, tiny_model_dir, iterations=25, entries=9))


def test_bad_input_is_refused_before_anything_starts(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.bad_input(tmp_path, tiny_model_dir))
