"""The CPU budget: how the launcher splits a machine's cores between trainer and engines."""

from __future__ import annotations

import pytest

from millstream.common import threads
from millstream.common.config import parse_run_config
from millstream.trainer.launcher import cpu_budget


@pytest.mark.parametrize(
    ("cores", "engines", "trainer", "expected"),
    [
        (2, 1, None, (1, 1)),  # this machine: one core each
        (16, 1, None, (8, 8)),
        (16, 2, None, (8, 4)),
        (3, 1, None, (2, 1)),  # the trainer rounds up
        (1, 1, None, (1, 1)),  # never zero threads, even when they must share
        (2, 4, None, (1, 1)),  # more engines than cores: engines share
        (8, 0, None, (8, 0)),  # no local engines: the trainer takes every core
        (8, 1, 2, (2, 6)),  # --num-threads fixes the trainer's share
    ],
)
def test_split_cores(cores, engines, trainer, expected):
    budget = threads.split_cores(cores, engines, trainer)
    assert (budget.trainer, budget.engine) == expected
    assert budget.trainer + budget.engine * engines <= max(cores, 1 + engines)


@pytest.mark.parametrize(
    ("cores", "engines", "expected"), [(2, 1, (2, 1)), (16, 2, (16, 4)), (8, 0, (8, 0))]
)
def test_in_sync_mode_the_trainer_takes_every_core_and_engines_keep_their_share(
    cores, engines, expected
):
    budget = threads.split_cores(cores, engines, overlap=False)
    assert (budget.trainer, budget.engine) == expected


def test_the_launcher_budget_follows_the_flags(monkeypatch):
    monkeypatch.setattr(threads, "machine_cores", lambda: 8)
    base = ["--rollout-batch-size", "4", "--rollout-num-engines", "2"]
    cfg = parse_run_config(base, mode="async", prog="millstream train-async")
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engine) == (4, 2)
    cfg = parse_run_config(base, mode="sync", prog="millstream train")
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engine) == (8, 2)
    cfg = parse_run_config(
        [*base, "--num-threads", "2", "--engine-num-threads", "3"], mode="sync", prog="t"
    )
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engine) == (2, 3)
    cfg = parse_run_config([*base, "--router-url", "http://r:1"], mode="sync", prog="t")
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engines) == (8, 0)
    assert "trainer 8 thread(s)" in cpu_budget(cfg).describe()


def test_child_pools_are_capped():
    env = threads.pool_env(1)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
