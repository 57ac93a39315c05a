"""The chaos suite, short: every fault of `make chaos` once or twice, in seconds per scenario
(worker kills, a Redis restart and poison share one run).

Real processes on loopback (redis-server with AOF, router, engines, workers, the trainer), the
tiny model; each test fails with the scenario's broken promises (lost groups, groups trained
twice, a worker that died, a reward of 0 for a broken reward function...).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import restarts, scenarios

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _ok(row: scenarios.Row) -> None:
    assert row.injected > 0, row
    assert row.ok, "\n".join(row.problems)


def test_worker_kills_a_redis_restart_and_poison_in_one_run(tiny_model_dir: Path, tmp_path: Path):
    for row in scenarios.mixed(tmp_path, tiny_model_dir, iterations=40):
        _ok(row)


@pytest.mark.long  # the engine's return: tests/integration/test_engines_come_back.py
def test_engine_killed_mid_generation(tiny_model_dir: Path, tmp_path: Path):
    # ~20 s of run: the restarted engine boots in 5-10 s on a busy 2-core machine and must be
    # synced in before the run ends (130 iterations, ~10 s, lost that race once in CI).
    _ok(scenarios.engine_killed(tmp_path, tiny_model_dir, iterations=260, kills=1, first_at=8))


@pytest.mark.long  # a killed trainer's resume: tests/e2e/test_run_end.py
def test_trainer_killed_mid_iteration_resumes(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.trainer_killed(tmp_path, tiny_model_dir, iterations=12, save_interval=4))


def test_bad_input_is_refused_before_anything_starts(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.bad_input(tmp_path, tiny_model_dir))


def test_a_50_mb_request_is_refused_and_the_router_serves_on(tiny_model_dir: Path, tmp_path: Path):
    _ok(scenarios.oversized_request(tmp_path, tiny_model_dir))


def test_an_admin_call_through_the_router_needs_its_token(tiny_model_dir: Path, tmp_path: Path):
    _ok(restarts.unauthenticated_admin(tmp_path, tiny_model_dir))


@pytest.mark.long  # SIGTERM's checkpoint and summary: tests/e2e/test_run_end.py
def test_the_trainer_terminated_exits_130_within_its_stall_bound_and_resumes(
    tiny_model_dir: Path, tmp_path: Path
):
    row = restarts.trainer_terminated(tmp_path, tiny_model_dir, iterations=12)
    _ok(row)
    assert row.stall_bound_s is not None and row.longest_stall_s is not None
