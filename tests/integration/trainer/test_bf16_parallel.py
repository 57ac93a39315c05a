"""--bf16 beyond one rank of the torch backend (backends/precision.py): two data parallel torch
ranks (the masters' fp32 gradients summed in place of DDP's bf16 buckets), FSDP2 with its own
mixed precision (fp32 shards, bf16 compute, fp32 reduce-scatter), and the megatron backend
(TransformerConfig bf16, fp32 masters) on one rank, two data parallel ranks, and two tensor
(sequence parallel), pipeline or context parallel ranks. Each is one step on the tiny model from
the same weights, against the fp32 step (test_bf16.py's tolerances) and against one rank of the
same backend in bf16 (a sum of bf16 gradients, or a mean, shows there); then a save and a
resume, which must give back the fp32 masters bit for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from millstream.common.config import parse_run_config
from tests.integration.trainer.test_data_parallel import build_backend
from tests.support.redis_server import free_port
from tests.unit.trainer.backends.test_bf16 import LOGPROB_ATOL, _samples

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(180)

# Adam with eps 1 and lr 1: its first update, g / (|g| + 1), is smooth in the gradient, so two
# ways of summing the same fp32 gradients agree to float rounding, while bf16's rounding of a
# gradient (2^-9 of it) moves the largest weights by ~1e-3. An entropy bonus, so that the
# loss (an on-policy GRPO loss is -mean(advantage), whatever the model) depends on the logits.
FLAGS = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--optimizer", "adam",
         "--lr", "1", "--adam-eps", "1", "--clip-grad", "0", "--entropy-coef", "0.1"]  # fmt: skip
MEGATRON = ["--train-backend", "megatron"]
# Two spawns of two ranks (each within a test's time): the torch backend's runs, megatron's.
TORCH_RUNS = {"ddp": [], "fsdp": ["--train-backend", "fsdp"]}
MEGATRON_RUNS = {
    "megatron-dp2": MEGATRON,
    # sequence parallel: the norms' gradients, each rank's share, summed on the masters
    "megatron-tp2-sp": [*MEGATRON, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    # the tied embedding's two copies, whose gradients are summed on their masters
    "megatron-pp2": [*MEGATRON, "--pipeline-model-parallel-size", "2"],
    "megatron-cp2": [*MEGATRON, "--context-parallel-size", "2"],
}
# Two ranks that each hold the whole masters, each the same after the step.
REPLICATED = ("ddp", "megatron-dp2")
# The runs whose one rank in bf16 computes what the two do (no matmul split), the sums of the
# gradients in another order only: that backend's flags.
ONE_RANK = {"ddp": [], "fsdp": [], "megatron-dp2": MEGATRON}
# fp32 sums of the same bf16 gradients in two orders: float rounding of the update.
SUM_ATOL = 1e-5
# The bf16 step against the fp32 one: the fp32 step moves weights by up to 0.21; the bf16
# weights are within 2e-3 of its weights (their bf16 rounding alone is up to 1.95e-3).
STEP_ATOL = 1e-2


def _masters(backend) -> list[torch.Tensor]:
    """This rank's fp32 masters: MasterWeights', or FSDP's fp32 shards (local)."""
    if backend.master is not None:
        return [m.detach().clone() for m in backend.master.params]
    return [p.to_local().detach().clone() for p in backend.model.parameters()]


def _full_masters(backend) -> list[torch.Tensor]:
    """The whole fp32 masters (FSDP: gathered, a collective), in parameter order."""
    if backend.master is not None:
        return [m.detach().clone() for m in backend.master.params]
    return [p.full_tensor().detach().clone() for p in backend.model.parameters()]


def _one_rank(flags: list[str], model: str) -> dict:
    """One rank of the same backend in bf16 (not data parallel): its masters after the step."""
    backend = build_backend(parse_run_config([*FLAGS, "--bf16", *flags]), model)
    metrics = backend.train_rollout(_samples(), 1)
    return {"masters": _full_masters(backend), "metrics": metrics}


def _run(rank: int, model: str, out: Path, name: str, flags: list[str]) -> None:
    import torch.distributed as dist

    from millstream.trainer.backends.distributed import DataParallel, send_stop

    cfg = parse_run_config([*FLAGS, "--bf16", *flags])
    ckpt = out / "ckpt"
    backend = build_backend(cfg, model)
    dp = DataParallel(backend)
    rec: dict = {"logprobs": backend.logprobs(_samples())}  # every rank: FSDP's are collective
    with torch.no_grad():  # (before the step: FSDP's root keeps its weights gathered after it)
        ids = torch.tensor([[5, 6, 7]])
        rec["logits_dtype"] = backend._logits(backend.train_model, {"input_ids": ids}).dtype
    if rank == 0:
        rec["metrics"] = dp.train_rollout(_samples(), 1)
        ckpt.mkdir(parents=True)
        dp.save(ckpt)
        send_stop()
        saved = load_file(ckpt / "model" / "model.safetensors")
        config = json.loads((ckpt / "model" / "config.json").read_text())
        rec["saved"] = ({str(v.dtype) for v in saved.values()}, config["dtype"])
    else:
        dp.follow()
    rec["param_dtypes"] = {p.dtype for p in backend.model.parameters()}
    rec["masters"] = _masters(backend)
    rec["full_masters"] = _full_masters(backend) if name in ("fsdp", *REPLICATED) else None
    rec["state_dtypes"] = {
        v.dtype for per in backend.optimizer.state.values() for k, v in per.items()
        if isinstance(v, torch.Tensor) and k != "step"
    }  # fmt: skip
    rec["weights"] = {k: v.detach().clone() for k, v in dp.named_weights()}
    rec["split"] = [bool(getattr(p, "tensor_model_parallel", False)) and "tp2" in name
                    for p in backend.model.parameters()]  # fmt: skip
    # Resumed from the checkpoint, as a run's ranks are: FSDP loads the weights before it shards.
    resumed = build_backend(cfg, model)
    if name == "fsdp":
        resumed.load_weights(ckpt)
    dp2 = DataParallel(resumed)
    dp2.load(ckpt)
    rec["resumed_masters"] = _masters(resumed)
    rec["resumed_weights"] = {k: v.detach().clone() for k, v in dp2.named_weights()}
    if name in ONE_RANK:
        rec["one_rank"] = _one_rank(ONE_RANK[name], model)
    torch.save(rec, out / f"rank{rank}.pt")
    dist.barrier()


def _rank(rank: int, world: int, port: int, model: str, out: str, runs: dict) -> None:
    from millstream.trainer.backends.distributed import init, shutdown

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    init()
    try:
        for name, flags in runs.items():
            _run(rank, model, Path(out) / name, name, flags)
    finally:
        shutdown()


def _spawn(model: Path, out: Path, runs: dict[str, list[str]]) -> Path:
    mp.spawn(_rank, args=(2, free_port(), str(model), str(out), runs), nprocs=2)
    return out


@pytest.fixture(scope="module")
def torch_runs(tiny_model_dir, tmp_path_factory) -> Path:
    return _spawn(tiny_model_dir, tmp_path_factory.mktemp("bf16-torch"), TORCH_RUNS)


@pytest.fixture(scope="module")
def megatron_runs(tiny_model_dir, tmp_path_factory) -> Path:
    return _spawn(tiny_model_dir, tmp_path_factory.mktemp("bf16-megatron"), MEGATRON_RUNS)


@pytest.fixture(scope="module")
def fp32_step(tiny_model_dir) -> dict:
    """The one-rank fp32 step (the torch backend: every fp32 path takes it, test_data_parallel
    and test_megatron_model show): log-probs before, metrics, weights after."""
    backend = build_backend(parse_run_config(FLAGS), str(tiny_model_dir))
    start = {k: v.detach().clone() for k, v in backend.named_weights()}
    logprobs = backend.logprobs(_samples())
    metrics = backend.train_rollout(_samples(), 1)
    weights = dict(backend.named_weights())
    return {"logprobs": logprobs, "metrics": metrics, "start": start, "weights": weights}


@pytest.mark.parametrize("name", [*TORCH_RUNS, *MEGATRON_RUNS])
def test_bf16_on_two_ranks_steps_fp32_masters_and_resumes_them(request, fp32_step, name):
    runs = request.getfixturevalue("megatron_runs" if name in MEGATRON_RUNS else "torch_runs")
    ranks = [torch.load(runs / name / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    rec = ranks[0]
    # bf16 compute, fp32 log-probs within bf16's rounding of the fp32 model's
    for want, got in zip(fp32_step["logprobs"], rec["logprobs"], strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=LOGPROB_ATOL, rtol=0)
    logp_diff = max(
        float((g - w).abs().max())
        for w, g in zip(fp32_step["logprobs"], rec["logprobs"], strict=True)
    )
    assert logp_diff > 1e-5, "bf16 computed nothing in bf16"
    assert rec["metrics"]["loss"] == pytest.approx(fp32_step["metrics"]["loss"], abs=0.02)
    assert rec["metrics"]["grad_norm"] == pytest.approx(fp32_step["metrics"]["grad_norm"], rel=0.05)
    for r in ranks:
        assert r["logits_dtype"] == torch.bfloat16
        assert {m.dtype for m in r["masters"]} == r["state_dtypes"] == {torch.float32}
        # the parameters are the bf16 weights; FSDP's sharded ones are the fp32 masters
        assert r["param_dtypes"] == {torch.float32 if name == "fsdp" else torch.bfloat16}
        # the resume has the masters bit for bit, not model/'s bf16 rounding of them
        for saved, resumed in zip(r["masters"], r["resumed_masters"], strict=True):
            assert torch.equal(saved, resumed), "the resume lost the fp32 masters"
        assert any(not torch.equal(m, m.bfloat16().float()) for m in r["masters"])
    # rank 0's weights (weight sync, model/) are bf16, the masters' rounding, and a resume's too
    assert rec["saved"] == ({"torch.bfloat16"}, "bfloat16")
    weights = rec["weights"]
    assert set(weights) == set(fp32_step["weights"])
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    for key, want in fp32_step["weights"].items():  # the fp32 step, within bf16's rounding
        torch.testing.assert_close(weights[key].float(), want, atol=STEP_ATOL, rtol=0)
    assert max(float((fp32_step["weights"][k] - fp32_step["start"][k]).abs().max())
               for k in fp32_step["start"]) > 10 * STEP_ATOL  # fmt: skip
    assert all(torch.equal(rec["resumed_weights"][k], w) for k, w in weights.items())
    if name in ("ddp", "fsdp"):  # Hugging Face names, in the masters' order
        for w, m in zip(weights.values(), rec["full_masters"], strict=True):
            assert torch.equal(w, m.to(torch.bfloat16))
    if name in REPLICATED:  # every rank steps the same masters the same way
        for a, b in zip(ranks[0]["masters"], ranks[1]["masters"], strict=True):
            assert torch.equal(a, b), "the ranks stepped different masters"
    if "tp2" in name:  # the norms are whole on both tensor parallel ranks, and equal
        whole = [i for i, split in enumerate(rec["split"]) if not split]
        assert whole and len(whole) < len(rec["split"])
        for i in whole:
            assert torch.equal(ranks[0]["masters"][i], ranks[1]["masters"][i]), i
    if name in ONE_RANK:
        # One rank of it in bf16 sums the same bf16 gradients in fp32, in another order.
        one = rec["one_rank"]
        for got, want in zip(rec["full_masters"], one["masters"], strict=True):
            torch.testing.assert_close(got, want, atol=SUM_ATOL, rtol=0)
        assert rec["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], abs=1e-6)
