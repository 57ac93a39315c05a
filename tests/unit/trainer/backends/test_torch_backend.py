"""The torch backend: logprobs as the engine defines them, micro-batching, the update's direction,
the LR schedule, and a checkpoint round trip."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from millstream.common.config import parse_run_config
from millstream.trainer.admission import Admission, TerminalCounts
from millstream.trainer.backends.base import TrainSample
from millstream.trainer.backends.loop import load_causal_lm
from millstream.trainer.backends.optim import fusable, lr_factor, make_optimizer
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.checkpoints import checkpoint


def _cfg(*extra: str):
    return parse_run_config(
        ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--lr", "1e-2", *extra]
    )


def _samples() -> list[TrainSample]:
    return [
        TrainSample(
            tokens=[10, 11, 12, 13, 14],
            prompt_len=2,
            loss_mask=[1, 1, 1],
            rollout_logprobs=[-1.0] * 3,
            reward=1.0,
        ),
        TrainSample(
            tokens=[20, 21, 22],
            prompt_len=2,
            loss_mask=[1],
            rollout_logprobs=[-1.0],
            reward=-1.0,
        ),
        TrainSample(
            tokens=[30, 31, 32, 33],
            prompt_len=1,
            loss_mask=[1, 0, 1],
            rollout_logprobs=[-1.0] * 3,
            reward=0.5,
        ),
        TrainSample(
            tokens=[40, 41, 42, 43],
            prompt_len=3,
            loss_mask=[1],
            rollout_logprobs=[-1.0],
            reward=-0.5,
        ),
    ]


def test_logprobs_equal_a_direct_forward(tiny_model_dir):
    backend = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=1)
    model = load_causal_lm(tiny_model_dir)
    got = backend.logprobs(_samples())
    for s, logp in zip(_samples(), got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0]
        expected = torch.log_softmax(logits, -1)[
            torch.arange(s.prompt_len - 1, len(s.tokens) - 1), s.tokens[s.prompt_len :]
        ]
        torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)


def test_logprobs_use_the_rollout_temperature(tiny_model_dir):
    hot = TorchBackend(
        _cfg("--rollout-temperature", "2.0"), tiny_model_dir, ref_dir=None, total_steps=1
    )
    model = load_causal_lm(tiny_model_dir)
    s = _samples()[0]
    with torch.no_grad():
        logits = model(torch.tensor([s.tokens])).logits[0] / 2.0
    expected = torch.log_softmax(logits, -1)[torch.arange(1, 4), torch.tensor(s.tokens[2:])]
    torch.testing.assert_close(hot.logprobs([s])[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
def test_micro_batches_give_the_whole_batch_gradient(tiny_model_dir, per_token):
    extra = ["--calculate-per-token-loss"] if per_token else []
    grads = []
    for mbs in ("4", "1"):
        backend = TorchBackend(
            _cfg("--micro-batch-size", mbs, *extra), tiny_model_dir, ref_dir=None, total_steps=1
        )
        backend.accumulate_gradients(_samples(), backend.prepare([_samples()]))
        grads.append(
            torch.cat([p.grad.flatten() for p in backend.model.parameters() if p.grad is not None])
        )
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)


def test_a_context_parallel_group_packs_with_its_ranks_budgets_together(tiny_model_dir):
    """Miles' --max-tokens-per-gpu under --context-parallel-size N: each rank holds 1/N of a
    packed row, so a row holds N times the budget (the megatron backend sets N)."""
    backend = TorchBackend(_cfg("--use-dynamic-batch-size", "--max-tokens-per-gpu", "5"),
                           tiny_model_dir, ref_dir=None, total_steps=1)  # fmt: skip
    assert backend._micro_batches(_samples()) == [[0], [1], [2], [3]]
    backend.context_parallel = 2
    assert backend._micro_batches(_samples()) == [[0, 2], [1, 3]]


def test_a_step_moves_probability_toward_positive_advantage(tiny_model_dir):
    backend = TorchBackend(
        _cfg("--optimizer", "sgd", "--clip-grad", "0"), tiny_model_dir, ref_dir=None, total_steps=1
    )
    samples = _samples()[:2]
    before = [lp.sum().item() for lp in backend.logprobs(samples)]
    metrics = backend.train_rollout(samples, num_steps=1)
    after = [lp.sum().item() for lp in backend.logprobs(samples)]
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["ppo_kl"] == 0 and metrics["pg_clipfrac"] == 0 and metrics["grad_norm"] > 0


def test_two_steps_keep_the_old_policy_fixed(tiny_model_dir):
    backend = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=2)
    metrics = backend.train_rollout(_samples(), num_steps=2)
    assert metrics["ppo_kl"] != 0  # the second step sees a policy that moved away from the old one


def test_kl_to_the_reference_is_zero_before_training(tiny_model_dir):
    cfg = _cfg("--use-kl-loss", "--kl-loss-coef", "0.1", "--optimizer", "sgd")
    backend = TorchBackend(cfg, tiny_model_dir, ref_dir=tiny_model_dir, total_steps=1)
    metrics = backend.train_rollout(_samples(), num_steps=1)
    assert metrics["kl_loss"] == pytest.approx(0.0, abs=1e-7)


def test_lr_schedule_warmup_and_decay():
    cfg = _cfg("--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-3")
    factors = [lr_factor(step, cfg, total_steps=12) for step in range(12)]
    assert factors[0] == pytest.approx(0.5) and factors[1] == pytest.approx(1.0)
    assert factors[2] == pytest.approx(1.0) and factors[-1] > 0.1 - 1e-9
    assert all(a >= b for a, b in itertools.pairwise(factors[1:]))
    assert lr_factor(5, _cfg(), total_steps=12) == 1.0


def test_checkpoint_round_trip(tiny_model_dir, tmp_path):
    a = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=4)
    a.train_rollout(_samples(), num_steps=1)
    path = checkpoint.save(tmp_path, 3, a, {"version": 3}, save_optimizer=True)
    assert checkpoint.latest_iteration(tmp_path) == 3 and (path / "model" / "config.json").is_file()
    b = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=4)
    b.load(path)
    for (name, pa), (_, pb) in zip(a.named_weights(), b.named_weights(), strict=True):
        assert torch.equal(pa, pb), name
    assert b.scheduler.last_epoch == a.scheduler.last_epoch
    assert checkpoint.load_state(tmp_path, 3)["version"] == 3


def test_admission_budget_follows_the_staleness_formula():
    adm = Admission(
        redis=None, stream="s", source=None, rollout_batch_size=4, n_samples=2, max_staleness=0
    )  # type: ignore[arg-type]
    assert adm.room(version=0) == 4
    adm.counts = TerminalCounts(admitted=4)
    assert adm.room(0) == 0 and adm.room(1) == 4
    adm.counts = dataclasses.replace(adm.counts, filtered=1, failed=1)
    assert adm.room(0) == 2  # filtered and failed groups are replaced
    async_adm = dataclasses.replace(adm, max_staleness=2, slack=3)
    assert async_adm.room(0) == 3 * 4 + 3 - 2


def test_adam_steps_fused_with_the_defaults_numbers():
    """Plain parameters step with torch's fused AdamW (one pass per tensor, as megatron's and
    transformers' Trainer's), landing where torch's default AdamW lands."""
    cfg = _cfg("--lr", "1e-2", "--weight-decay", "0.1", "--adam-beta1", "0.8")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused, _ = make_optimizer(params, cfg, cfg.optimizer.lr, total_steps=10)
    default = torch.optim.AdamW(twins, lr=1e-2, betas=(0.8, 0.999), weight_decay=0.1)
    assert fused.defaults["fused"] and not default.defaults["fused"]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for group, opt in ((params, fused), (twins, default)):
            for p, g in zip(group, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for p, twin in zip(params, twins, strict=True):
        torch.testing.assert_close(p, twin)
    # Sharded (DTensor) parameters keep torch's default.
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        mesh = DeviceMesh("cpu", [0])
        shard = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
        assert not fusable([shard]) and fusable(params)
    finally:
        torch.distributed.destroy_process_group()
