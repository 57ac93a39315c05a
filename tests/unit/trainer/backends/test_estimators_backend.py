"""The estimators wired through the torch backend: samples from scored groups, the forwards
each estimator needs (old, reference, critic, teacher), dynamic batching that leaves the
gradient unchanged, several steps per rollout, PPO's critic and its checkpoint."""

from __future__ import annotations

import pytest
import torch

from millstream.common.config import parse_run_config
from millstream.common.types import PromptGroup, Sample, SampleGroup, ScoredGroup
from millstream.trainer.algorithms.advantages import token_advantages
from millstream.trainer.algorithms.loss import approx_kl
from millstream.trainer.backends.rows import pad
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.batch import build_samples
from millstream.trainer.checkpoints import checkpoint
from tests.support.tiny_model import build_tiny_model
from tests.unit.trainer.backends.test_torch_backend import _samples


def _cfg(*extra: str):
    return parse_run_config(
        ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--lr", "1e-2", *extra]
    )


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=7)


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _group(gid: str, rewards: list[float], versions: list[int]) -> ScoredGroup:
    samples = [
        Sample(group_id=gid, index=i, prompt_token_ids=[1, 2], response_token_ids=[3, 4, 5],
               rollout_logprobs=[-1.0] * 3, weight_versions=[v, v, v + 1], reward=r)
        for i, (r, v) in enumerate(zip(rewards, versions, strict=True))
    ]  # fmt: skip
    return ScoredGroup(group=SampleGroup(prompt=PromptGroup(group_id=gid), samples=samples))


def test_samples_carry_the_estimators_reward_and_the_behaviour_version():
    groups = [_group("a", [1.0, 0.0], [3, 4]), _group("b", [2.0, 2.0], [4, 4])]
    samples, stats = build_samples(
        groups, 5, _cfg("--advantage-estimator", "reinforce_plus_plus_baseline")
    )
    assert [s.reward for s in samples] == [0.5, -0.5, 0.0, 0.0]
    assert [s.behavior_version for s in samples] == [3, 4, 4, 4]
    assert [s.version_lag for s in samples] == [2, 1, 1, 1]
    assert stats["behavior_version_min"] == 3 and stats["staleness_max"] == 2
    raw, _ = build_samples(groups, 5, _cfg("--advantage-estimator", "ppo"))
    assert [s.reward for s in raw] == [1.0, 0.0, 2.0, 2.0]


def test_packed_logprobs_equal_padded(tiny_model_dir):
    padded = TorchBackend(
        _cfg("--micro-batch-size", "4"), tiny_model_dir, ref_dir=None, total_steps=1
    )
    packed = TorchBackend(
        _cfg("--use-dynamic-batch-size", "--max-tokens-per-gpu", "100"), tiny_model_dir,
        ref_dir=None, total_steps=1,
    )  # fmt: skip
    assert packed._micro_batches(_samples()) == [[0, 1, 2, 3]]  # one packed row
    for a, b in zip(padded.logprobs(_samples()), packed.logprobs(_samples()), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("cap", ["4", "8"])  # 4: the 5-token sample is alone, over the cap
def test_dynamic_batching_gives_the_unpacked_gradient(tiny_model_dir, per_token, cap):
    extra = ["--calculate-per-token-loss"] if per_token else []
    extra += ["--use-kl-loss", "--kl-loss-coef", "0.1", "--entropy-coef", "0.01"]
    grads = []
    for flags in (
        ["--micro-batch-size", "4"],
        ["--use-dynamic-batch-size", "--max-tokens-per-gpu", cap],
    ):
        backend = TorchBackend(
            _cfg(*flags, *extra), tiny_model_dir, ref_dir=tiny_model_dir, total_steps=1
        )
        backend.model.double()
        backend.ref.double()  # type: ignore[union-attr]
        if "--max-tokens-per-gpu" in flags:
            batches = backend._micro_batches(_samples())
            assert len(batches) > 1 and sorted(i for b in batches for i in b) == [0, 1, 2, 3]
            if cap == "4":
                assert [0] in batches  # 5 tokens > 4: alone
        backend.accumulate_gradients(_samples(), backend.prepare([_samples()]))
        grads.append(_flat_grad(backend.model))
    assert grads[0].dtype == torch.float64
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-12)


def test_several_steps_use_the_old_policy_recomputed_before_the_first(tiny_model_dir):
    cfg = _cfg("--num-steps-per-rollout", "2")
    backend = TorchBackend(cfg, tiny_model_dir, ref_dir=None, total_steps=2)
    backend.train_rollout(_samples(), num_steps=2)
    first, second = backend.step_metrics
    assert first["ppo_kl"] == 0 and first["pg_clipfrac"] == 0  # the ratio is exactly 1
    assert second["ppo_kl"] != 0  # the old policy stayed fixed while the actor moved


def test_reward_side_kl_uses_the_old_policy_against_the_reference(tiny_model_dir, teacher_dir):
    flags = ["--advantage-estimator", "reinforce_plus_plus", "--use-kl-in-reward",
             "--kl-coef", "0.5", "--gamma", "0.9"]  # fmt: skip
    backend = TorchBackend(_cfg(*flags), tiny_model_dir, ref_dir=teacher_dir, total_steps=1)
    samples = _samples()
    got = backend.prepare([samples]).advantages
    old, ref = backend.logprobs(samples), backend.logprobs(samples, backend.ref)
    T = max(s.response_len for s in samples)
    mask_BT = pad([s.loss_mask for s in samples], T)
    want_BT, _ = token_advantages(
        torch.tensor([s.reward for s in samples]), mask_BT, backend.cfg.algo,
        kl_BT=approx_kl(pad(old, T), pad(ref, T), "k1"),
    )  # fmt: skip
    no_kl_BT, _ = token_advantages(
        torch.tensor([s.reward for s in samples]), mask_BT, _cfg(*flags[:2], "--gamma", "0.9").algo
    )
    for i, s in enumerate(samples):
        torch.testing.assert_close(got[i], want_BT[i, : s.response_len])
    assert not torch.allclose(want_BT, no_kl_BT)  # the reference model made a difference


def test_distillation_from_a_local_teacher(tiny_model_dir, teacher_dir):
    flags = ["--advantage-estimator", "on_policy_distillation", "--opd-teacher-load",
             str(teacher_dir), "--opd-kl-coef", "0.7"]  # fmt: skip
    backend = TorchBackend(
        _cfg(*flags), tiny_model_dir, ref_dir=None, teacher_dir=teacher_dir, total_steps=1
    )
    samples = [s.__class__(**{**vars(s), "reward": 0.0}) for s in _samples()]  # group stage: 0
    got = backend.prepare([samples]).advantages
    student, teacher = backend.logprobs(samples), backend.logprobs(samples, backend.teacher)
    for s, adv, st, te in zip(samples, got, student, teacher, strict=True):
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        torch.testing.assert_close(adv, -0.7 * (st - te) * mask)
    assert any(a.abs().max() > 0 for a in got)


def test_distillation_from_engine_logprobs_on_top_of_grpo(tiny_model_dir):
    flags = ["--use-opd", "--opd-teacher-url", "http://teacher:1", "--opd-kl-coef", "1"]
    backend = TorchBackend(_cfg(*flags), tiny_model_dir, ref_dir=None, total_steps=1)
    student = backend.logprobs(_samples())
    # A teacher that agrees with the student leaves the GRPO advantage alone.
    samples = [
        s.__class__(**{**vars(s), "teacher_logprobs": st.tolist()})
        for s, st in zip(_samples(), student, strict=True)
    ]
    for s, adv in zip(samples, backend.prepare([samples]).advantages, strict=True):
        want = torch.tensor([s.reward * m for m in s.loss_mask])
        torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
    short = [s.__class__(**{**vars(s), "teacher_logprobs": [-1.0]}) for s in _samples()]
    with pytest.raises(Exception, match="teacher logprobs"):
        backend.prepare([short])


def _ppo(tiny_model_dir, *extra: str) -> TorchBackend:
    cfg = _cfg("--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.8", *extra)
    return TorchBackend(cfg, tiny_model_dir, ref_dir=None, critic_dir=tiny_model_dir, total_steps=8)


def test_ppo_critic_learns_the_returns(tiny_model_dir):
    backend = _ppo(tiny_model_dir, "--critic-lr", "3e-3")
    samples = _samples()
    first = backend.prepare([samples])
    assert all(v.abs().max() == 0 for v in first.values)  # type: ignore[union-attr]
    metrics = [backend.train_rollout(samples, 1) for _ in range(8)]
    assert (metrics[0]["critic_lr"], metrics[0]["lr"]) == (3e-3, 1e-2)
    losses = [m["value_loss"] for m in metrics]
    assert losses[-1] < losses[0] / 2
    assert any(v.abs().max() > 0 for v in backend.values(samples))


def test_ppo_critic_only_rollouts_leave_the_actor(tiny_model_dir):
    backend = _ppo(tiny_model_dir, "--num-critic-only-steps", "1")
    actor = [p.detach().clone() for p in backend.model.parameters()]
    critic = [p.detach().clone() for p in backend.critic.parameters()]  # type: ignore[union-attr]
    metrics = backend.train_rollout(_samples(), 1, rollout_id=0)
    assert "pg_loss" not in metrics and "value_loss" in metrics
    assert all(torch.equal(a, p) for a, p in zip(actor, backend.model.parameters(), strict=True))
    assert not all(
        torch.equal(c, p)
        for c, p in zip(critic, backend.critic.parameters(), strict=True)  # type: ignore[union-attr]
    )
    backend.train_rollout(_samples(), 1, rollout_id=1)
    assert not all(
        torch.equal(a, p) for a, p in zip(actor, backend.model.parameters(), strict=True)
    )


def test_ppo_checkpoint_holds_the_critic_and_its_optimizer(tiny_model_dir, tmp_path):
    a = _ppo(tiny_model_dir)
    a.train_rollout(_samples(), 1)
    path = checkpoint.save(tmp_path, 1, a, {"version": 1}, save_optimizer=True)
    b = _ppo(tiny_model_dir)
    b.load(path)
    for pa, pb in zip(a.critic.parameters(), b.critic.parameters(), strict=True):  # type: ignore[union-attr]
        assert torch.equal(pa, pb)
    assert b.critic_scheduler.last_epoch == a.critic_scheduler.last_epoch == 1
    assert (
        b.critic_optimizer.state_dict()["state"].keys()
        == a.critic_optimizer.state_dict()["state"].keys()
    )
    # --critic-load of a saved critic starts from it, value head included.
    c = TorchBackend(a.cfg, tiny_model_dir, ref_dir=None, critic_dir=path / "critic", total_steps=8)
    torch.testing.assert_close(c.values(_samples())[0], a.values(_samples())[0])
