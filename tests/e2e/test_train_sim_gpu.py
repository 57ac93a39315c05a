"""The whole loop with the trainer on a simulated GPU (tests/support/sim_cuda): `millstream
train`, whose process is the trainer, run by `python -m tests.support.sim_cuda`, so the
actor, its optimizer and --offload-train's moves are on "cuda:0" while the services it starts
(engine, router, workers) are CPU processes as always. A colocated --bf16 run there writes a
checkpoint every iteration, and a CPU run resumes from it.

Long (`make test-long`): the steps on the device are `make test`'s in
tests/unit/trainer/backends/test_train_sim_cuda.py, the offload's round trip and the
checkpoint resumed on the CPU too; this is the trainer's service around them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_job import job_flags, write_prompts
from tests.support.tiny_model import build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def _train(module: str, flags: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, "train", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.long  # its steps on the device: tests/unit/trainer/backends/test_train_sim_cuda.py
def test_a_colocated_bf16_run_on_the_simulated_gpu_resumes_on_the_cpu(tmp_path: Path):
    model = build_tiny_model(tmp_path / "model")
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    saved = tmp_path / "checkpoints"

    def flags(run: str, rollouts: int, *extra: str) -> list[str]:
        return job_flags(
            model, prompts, tmp_path / run, "--num-rollout", str(rollouts), "--bf16",
            "--lr", "1e-3", "--rollout-temperature", "1.0",
            "--custom-rm-path", "tests.support.reward_plugins.spread", *extra, rm_type=None,
        )  # fmt: skip

    gpu = _train(
        "tests.support.sim_cuda",
        flags(
            "gpu", 2, "--colocate", "--offload-train", "--save", str(saved), "--save-interval", "1"
        ),
    )
    assert gpu.returncode == 0, gpu.stdout[-3000:] + gpu.stderr[-3000:]
    assert "[trainer] the actor on cuda:0, bfloat16 (fp32 masters)" in gpu.stdout
    assert "iter 2/2" in gpu.stdout and "ended: finished" in gpu.stdout

    cpu = _train("millstream.cli", flags("cpu", 3, "--load", str(saved)))
    assert cpu.returncode == 0, cpu.stdout[-3000:] + cpu.stderr[-3000:]
    assert "[trainer] the actor on cpu, bfloat16 (fp32 masters)" in cpu.stdout
    assert "resumed at iteration 2" in cpu.stdout and "iter 3/3" in cpu.stdout
