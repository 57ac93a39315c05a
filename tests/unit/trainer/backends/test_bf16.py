"""--bf16 with Megatron's meaning (backends/precision.py): bf16 weights and activations, fp32
master weights, optimizer state, log-probs and loss. On CPU: slow, but the same numerics as on a
GPU, so `make test` proves them."""

from __future__ import annotations

import pytest
import torch

from millstream.common.config import checks, parse_run_config
from millstream.trainer.backends.base import TrainSample
from millstream.trainer.backends.torch_backend import TorchBackend

# bf16 keeps 8 bits of mantissa: a log-prob of ~-5 is off by up to ~0.03 after a few layers
# of bf16 matmuls on the tiny model; the fp32 path agrees with itself to 1e-6.
LOGPROB_ATOL = 0.05


def _cfg(*extra: str):
    return parse_run_config(
        ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--lr", "1e-2", *extra]
    )


def _samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(4):
        n = 3 + k
        tokens = torch.randint(3, 60, (2 + n,), generator=g).tolist()
        out.append(TrainSample(tokens=tokens, prompt_len=2, loss_mask=[1] * n,
                               rollout_logprobs=[-4.0] * n, reward=float(k % 2) - 0.5))  # fmt: skip
    return out


def test_bf16_computes_in_bf16_and_steps_fp32_masters(tiny_model_dir):
    fp32 = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=2)
    bf16 = TorchBackend(_cfg("--bf16"), tiny_model_dir, ref_dir=None, total_steps=2)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert bf16.master is not None and {p.dtype for p in bf16.master.params} == {torch.float32}

    # Log-probs are fp32 and within bf16's rounding of the fp32 model's.
    want, got = fp32.logprobs(_samples()), bf16.logprobs(_samples())
    for w, g in zip(want, got, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=LOGPROB_ATOL, rtol=0)
    assert max(float((g - w).abs().max()) for w, g in zip(want, got, strict=True)) > 1e-5

    m32 = fp32.train_rollout(_samples(), 1, 0)
    m16 = bf16.train_rollout(_samples(), 1, 0)
    assert m16["loss"] == pytest.approx(m32["loss"], abs=0.02)
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=0.05)
    state = bf16.optimizer.state[bf16.master.params[0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    # The step: the masters (the checkpoint's fp32 weights to start with) land where the fp32
    # model's weights do: Adam's first step is +-lr per weight, by the sign of its gradient,
    # and bf16's gradients flip the sign of only the smallest. The bf16 weights are the
    # masters' rounding, and no bf16 gradient is left behind (each went to its master).
    lr = 1e-2
    same = total = 0
    for (name, w32), m, w16 in zip(
        fp32.model.named_parameters(), bf16.master.params, bf16.model.parameters(), strict=True
    ):
        diff = (m.detach() - w32.detach()).abs()
        assert float(diff.max()) <= 2.5 * lr, name  # (and weight decay's lr * wd * w)
        same, total = same + int((diff < 1e-5).sum()), total + diff.numel()
        assert torch.equal(w16, m.detach().to(torch.bfloat16)), name
        assert w16.grad is None
    assert same / total > 0.9, same / total


def test_an_update_below_bf16s_spacing_moves_the_masters_not_the_weights(tiny_model_dir):
    """What the fp32 masters are for: lr 1e-6 is far below the spacing of a bf16 weight of
    size > 0.1 (2^-7 of it), so hardly one of them moves (only one that sat within 1e-6 of a
    rounding boundary), but every master with a gradient does: it keeps what a pure bf16
    model would lose."""
    backend = TorchBackend(_cfg("--bf16", "--lr", "1e-6"), tiny_model_dir, ref_dir=None,
                           total_steps=10)  # fmt: skip
    assert backend.master is not None
    before = [p.detach().clone() for p in backend.model.parameters()]
    masters = [m.detach().clone() for m in backend.master.params]
    backend.train_rollout(_samples(), 1, 0)
    moved = [not torch.equal(m, m0) for m, m0 in zip(backend.master.params, masters, strict=True)]
    assert sum(moved) >= len(moved) - 2  # every master with a gradient
    weights = torch.cat([p.detach().flatten().float() for p in backend.model.parameters()])
    kept = torch.cat([p.flatten().float() for p in before])
    big = kept.abs() > 0.1  # spacing >= 2^-7 x 0.1: a 1e-6 step flips 1 in ~400 at most
    assert float((weights[big] != kept[big]).float().mean()) < 0.01


def test_a_bf16_checkpoint_resumes_from_the_fp32_masters(tiny_model_dir, tmp_path):
    backend = TorchBackend(_cfg("--bf16"), tiny_model_dir, ref_dir=None, total_steps=3)
    backend.train_rollout(_samples(), 1, 0)
    backend.save(tmp_path)
    resumed = TorchBackend(_cfg("--bf16"), tiny_model_dir, ref_dir=None, total_steps=3)
    resumed.load(tmp_path)
    assert resumed.master is not None and backend.master is not None
    for a, b in zip(resumed.master.params, backend.master.params, strict=True):
        assert torch.equal(a, b)  # the fp32 weights, not the bf16 ones model/ holds
    for a, b in zip(resumed.model.parameters(), backend.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # Both take the same next step.
    m1, m2 = backend.train_rollout(_samples(), 1, 1), resumed.train_rollout(_samples(), 1, 1)
    assert m1["loss"] == m2["loss"] and m1["grad_norm"] == m2["grad_norm"]
    # Without the optimizer's state the masters start from the bf16 weights.
    fresh = TorchBackend(_cfg("--bf16"), tiny_model_dir, ref_dir=None, total_steps=3)
    fresh.load(tmp_path, load_optimizer=False)
    assert fresh.master is not None
    for m, p in zip(fresh.master.params, fresh.model.parameters(), strict=True):
        assert torch.equal(m, p.detach().float())


def test_bf16_is_taken_by_every_backend_and_rank_count():
    """The torch backend on one rank or several, FSDP and megatron (tests/unit/
    test_bf16_parallel.py trains each); checks.py refused all but the first before."""
    base = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rm-type", "math",
            "--num-rollout", "1", "--bf16"]  # fmt: skip
    for extra in ([], ["--train-backend", "fsdp"], ["--train-backend", "megatron"]):
        for world in ("1", "2"):
            checks.check(_cfg(*base, *extra), environ={"WORLD_SIZE": world})
    tp2 = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"]
    checks.check(_cfg(*base, *tp2), environ={"WORLD_SIZE": "2"})


def test_bf16_with_megatrons_distributed_optimizer_on_a_gpu_is_refused_by_name(
    tiny_model_dir, monkeypatch
):
    """Not built: megatron's distributed optimizer keeping the masters (a GPU's only; on a CPU
    the flag keeps the plain optimizer, which steps MasterWeights). Refused before any model
    is loaded."""
    from millstream.common.errors import MillstreamError
    from millstream.trainer.backends.megatron.backend import MegatronBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _cfg("--bf16", "--train-backend", "megatron", "--use-distributed-optimizer")
    with pytest.raises(MillstreamError, match="--bf16 with --use-distributed-optimizer on a GPU"):
        MegatronBackend(cfg, tiny_model_dir, ref_dir=None, total_steps=1)
