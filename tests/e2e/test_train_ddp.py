"""`millstream train` under torchrun with two trainer ranks (gloo on CPU): rank 0 runs the
loop and the services, rank 1 only trains; both exit cleanly and nothing is left running."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.e2e.test_train import (  # noqa: F401
    _check_run,
    _flags,
    _spread_reward,
    check_engine_serves,
    prompts,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(200)]


def _tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries MILLSTREAM_TEST_TAG=tag."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        if f"MILLSTREAM_TEST_TAG={tag}".encode() in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


# megatron's splits on one rank pair each: tests/integration/trainer/test_data_parallel.py (make test)
_LONG = pytest.mark.long


@pytest.mark.parametrize(
    "backend",
    ["fsdp", pytest.param("megatron-tp2", marks=_LONG), pytest.param("megatron-pp2", marks=_LONG)],
)
def test_two_trainer_ranks_under_torchrun(backend, tiny_model_dir, prompts, tmp_path):  # noqa: F811
    """fsdp: the actor sharded, its gathered weights synced to the engine and saved by rank 0
    with each rank's optimizer shard beside them; megatron-tp2: megatron-core's GPTModel split
    over the two ranks (tensor and sequence parallel), started as a Miles script starts it:
    --ref-load a torch_dist checkpoint (made by `millstream convert` from other weights than
    --hf-checkpoint's), which is the KL reference and the actor's first weights, pushed to
    the engine before the first rollout; saved the same way plus its torch_dist files,
    against an engine and router we started (--router-url): after the run the engine's
    logprobs equal a forward pass of the saved checkpoint, so the gathered TP shards are
    what it loaded; megatron-pp2: two pipeline stages, rank 0 the first (the loop and the
    services), rank 1 the last. The ranks' numbers (DDP, FSDP, megatron DP, TP, PP and CP
    against one rank): tests/integration/trainer/test_data_parallel.py; a one-rank megatron step:
    test_megatron_model.py."""
    extra = ["--train-backend", backend]
    if backend == "megatron-pp2":
        extra = ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2"]
    engine = router = None
    if backend == "megatron-tp2":
        from tests.support.engine_proc import EngineProcess
        from tests.support.router_proc import start_router

        ref = _converted_other_weights(tiny_model_dir, tmp_path)
        engine = EngineProcess(tiny_model_dir, tmp_path, "--weight-version", "0")
        router = start_router(tmp_path, "--worker-urls", engine.url)
        extra = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                 "--sequence-parallel", "--use-kl-loss", "--kl-loss-coef", "0.01",
                 "--ref-load", str(ref), "--router-url", router.url]  # fmt: skip
    try:
        out = _run_two_ranks(tiny_model_dir, prompts, tmp_path, extra)
        if engine is not None:
            assert (
                f"[trainer] the actor starts from the torch_dist checkpoint {ref / 'release'}"
                in out
            )
            first = json.loads((tmp_path / "run-ddp" / "metrics.jsonl").read_text().splitlines()[0])
            # The reference is the actor before its first step, and the engine sampled with
            # the same weights: both are --ref-load's, not --hf-checkpoint's (which differ
            # by ~0.35 nats a token).
            assert abs(first["kl_loss"]) < 1e-6, first
            assert first["train_rollout_logprob_abs_diff"] < 1e-4, first
            saved = tmp_path / "run-ddp" / "ckpt" / "iter_0000002"
            assert (
                json.loads((saved / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
            )
            check_engine_serves(engine.url, saved / "model", "2")
    finally:
        if router is not None:
            router.stop()
        if engine is not None:
            engine.stop()


def _converted_other_weights(model: Path, tmp_path: Path) -> Path:
    """`millstream convert hf-to-torch-dist` of `model` with every weight moved by noise."""
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other-weights"
    hf = AutoModelForCausalLM.from_pretrained(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    hf.save_pretrained(other)
    root = tmp_path / "other_torch_dist"
    convert = [sys.executable, "-m", "millstream.cli", "convert", "hf-to-torch-dist",
               "--hf-checkpoint", str(other), "--save", str(root)]  # fmt: skip
    proc = subprocess.run(convert, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _run_two_ranks(tiny_model_dir: Path, prompts: Path, tmp_path: Path, extra: list[str]) -> str:  # noqa: F811
    run_dir = tmp_path / "run-ddp"
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MILLSTREAM_TEST_TAG": tag}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "-m", "millstream.cli", "train"]  # fmt: skip
    flags = _spread_reward(_flags(tiny_model_dir, prompts, run_dir, "--num-rollout", "2", *extra,
                                  "--save", str(run_dir / "ckpt"), "--save-interval", "2"))  # fmt: skip
    child = subprocess.Popen(
        [*torchrun, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        out, err = child.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        _kill(_tagged(tag))
        out, err = child.communicate()
        pytest.fail(f"timed out:\n{out[-3000:]}{err[-3000:]}")
    left = _tagged(tag)
    _kill(left)
    _check_run(subprocess.CompletedProcess(child.args, child.returncode, out, err), run_dir, 2)
    assert left == [], "processes left behind"
    saved = run_dir / "ckpt" / "iter_0000002"
    optimizer = sorted(p.name for p in saved.glob("optimizer*.pt"))
    assert (saved / "model" / "model.safetensors").is_file()
    assert optimizer == ["optimizer.rank0.pt", "optimizer.rank1.pt"]
    return out


def _kill(pids: list[int]) -> None:
    for pid in pids:  # this run's own ranks and services, found by the tag
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
