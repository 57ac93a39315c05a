"""The estimators that need more than the policy, for two iterations through the real
services (engines, router, rollout and reward workers, the trainer and its weight syncs): a
reference model (reinforce++ with a KL loss), a critic (PPO), a teacher engine over HTTP
(on-policy distillation; from a model the trainer loads: test_estimators_backend). GRPO runs
through every other e2e test; GSPO and reinforce++ differ from these only in the objective,
which tests/unit (test_loss, test_advantages, test_estimators_backend) checks on the real
backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_train import _check_run, _flags, _records, _spread_reward, _train
from tests.support.engine_proc import EngineProcess
from tests.support.tiny_model import build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

# What each run adds to the common flags, and a metric only that estimator's run logs.
RUNS = {
    "reinforce_plus_plus_baseline": (
        ["--advantage-estimator", "reinforce_plus_plus_baseline", "--use-kl-loss",
         "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl",
         "--use-tis", "--tis-mode", "icepop", "--tis-clip-low", "0.5"],
        "tis_clipfrac",
    ),
    "ppo": (["--advantage-estimator", "ppo", "--gamma", "0.99", "--lambd", "0.95",
             "--num-steps-per-rollout", "2", "--use-dynamic-batch-size",
             "--max-tokens-per-gpu", "40"], "value_loss"),
    "on_policy_distillation-engine": (["--advantage-estimator", "on_policy_distillation"], None),
}  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(20))
    )
    return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=11)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_iterations_per_estimator(name, tiny_model_dir, teacher_dir, prompts, tmp_path):
    extra, metric = RUNS[name]
    run_dir = tmp_path / f"run-{name.replace('_', '-')}"
    extra = [*extra, "--num-rollout", "2", "--save", str(run_dir / "ckpt")]
    teacher = None
    if name.endswith("-engine"):
        teacher = EngineProcess(teacher_dir, tmp_path)
        extra += ["--opd-teacher-url", teacher.url]
    try:
        proc = _train("train", _spread_reward(_flags(tiny_model_dir, prompts, run_dir, *extra)))
    finally:
        if teacher is not None:
            teacher.stop()
    _check_run(proc, run_dir, 2)
    records = _records(run_dir)
    assert [r["version"] for r in records] == [1, 2]
    for r in records:
        assert all(isinstance(r[k], float) for k in ("pg_loss", "ppo_kl", "ess_ratio", "grad_norm"))
        if metric is not None:
            assert metric in r, sorted(r)
    latest = run_dir / "ckpt" / "iter_0000002"
    assert (latest / "model" / "config.json").is_file()
    if name == "ppo":
        assert (latest / "critic" / "value_head.safetensors").is_file()
        assert (latest / "critic" / "optimizer.pt").is_file()
    if name.startswith("on_policy_distillation"):
        # The advantage is the teacher's signal alone: it exists (the teacher differs).
        assert any(r["pg_loss"] != 0 for r in records)
