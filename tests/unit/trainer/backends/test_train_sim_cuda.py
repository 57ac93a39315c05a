"""The torch backend's training step and its offload on a simulated GPU (tests/support/sim_cuda).

On the CPU every tensor is on the one device, so a trainer that forgets a `.to(device)` (an
advantage, a mask or a reference logprob left on the host beside the device's logprobs; a
master or an optimizer state made on the host) passes every CPU test and fails at its first
step on a GPU. Here the trainer runs with torch seeing one GPU whose tensors refuse a host
tensor beside them as CUDA does, through its forwards, the backward (autograd runs on the
simulated device), the clipping, the optimizer and --offload-train's round trip; and it must
compute what the CPU computes.

What the simulation cannot show (memory, kernels, streams) stays in the GPU-marked tests:
test_colocate_gpu.py measures the offload's bytes, test_bf16.py's numerics hold on any device.
"""

from __future__ import annotations

import pytest
import torch

from millstream.trainer.backends.offload import TrainOffload
from millstream.trainer.backends.saving import OPTIMIZER_FILE
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.checkpoints import checkpoint
from tests.support.sim_cuda import simulated_cuda
from tests.support.tiny_model import build_tiny_model
from tests.unit.trainer.backends import test_bf16, test_torch_backend

pytestmark = pytest.mark.timeout(180)


def test_the_simulation_moves_parameters_as_a_gpu_does():
    """What training asks of the simulation itself: Module.to and `.data =` keep each
    Parameter object (the optimizer's), across devices too, with its post-accumulate hooks
    and pinned host memory; a cast inside the graph keeps the gradient's path."""
    with simulated_cuda():
        linear = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(linear.parameters(), lr=1.0)
        linear.to("cuda")
        assert all(p.is_cuda for p in optimizer.param_groups[0]["params"])
        seen: list[torch.device] = []
        linear.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.device))
        pinned = torch.empty(2, 4, pin_memory=True).copy_(linear.weight)
        linear.weight.data = pinned  # to the host, as an offload does
        assert not linear.weight.is_cuda and linear.weight.is_pinned()
        linear.weight.data = pinned.cuda()
        linear(torch.ones(3, 4, device="cuda")).to(torch.float64).sum().backward()
        assert seen == [torch.device("cuda", 0)]
        before = linear.weight.detach().clone()
        optimizer.step()
        torch.testing.assert_close((before - linear.weight).cpu(), torch.full((2, 4), 3.0))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("teacher"), seed=7)


# Each estimator and the paths of the step it takes: (flags, which extra models it loads).
# Adam's normalized update turns a gradient's last bits into a visible difference in a
# weight that barely moves, so the bf16 run steps with SGD, which keeps them proportional.
# fmt: off
CONFIGS = {
    "grpo": ([], ()),
    "bf16-masters": (["--bf16", "--optimizer", "sgd"], ()),
    "kl-loss-ref": (["--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl"],
                    ("ref",)),
    "ppo-critic": (["--advantage-estimator", "ppo", "--gamma", "0.9", "--lambd", "0.8"],
                   ("critic",)),
    "dynamic-batch": (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "8"], ()),
    "per-token-chunked-entropy": (["--calculate-per-token-loss", "--micro-batch-size", "1",
                                   "--log-probs-chunk-size", "2", "--entropy-coef", "0.01",
                                   "--rollout-temperature", "0.8"], ()),
    "reinforce++-kl-reward": (["--advantage-estimator", "reinforce_plus_plus",
                               "--use-kl-in-reward", "--kl-coef", "0.1",
                               "--normalize-advantages"], ("ref",)),
    "opd-teacher": (["--advantage-estimator", "on_policy_distillation", "--opd-kl-coef", "0.7"],
                    ("teacher",)),
    "gspo-tis": (["--advantage-estimator", "gspo", "--use-tis"], ()),
    "icepop-old-actor-sgd-clip": (["--use-tis", "--tis-mode", "icepop", "--keep-old-actor",
                                   "--optimizer", "sgd", "--clip-grad", "0.5",
                                   "--eps-clip-c", "3"], ()),
}
# fmt: on


def _train(flags: list[str], models: tuple[str, ...], actor, teacher):
    extra = ["--opd-teacher-load", str(teacher)] if "teacher" in models else []
    cfg = test_torch_backend._cfg(*flags, *extra)
    backend = TorchBackend(
        cfg, actor, total_steps=2,
        ref_dir=actor if "ref" in models else None,
        critic_dir=actor if "critic" in models else None,
        teacher_dir=teacher if "teacher" in models else None,
    )  # fmt: skip
    metrics = backend.train_rollout(test_torch_backend._samples(), num_steps=2)
    return backend, metrics


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_steps_on_the_simulated_gpu_compute_what_the_cpu_does(
    name, tiny_model_dir, teacher_dir
):
    flags, models = CONFIGS[name]
    host, want = _train(flags, models, tiny_model_dir, teacher_dir)
    with simulated_cuda():
        device, got = _train(flags, models, tiny_model_dir, teacher_dir)
        # It ran there: every model, the masters, and what the optimizers keep.
        held = [*device.model.parameters(), *(device.master.params if device.master else [])]
        for model in (device.ref, device.teacher, device.critic):
            held += list(model.parameters()) if model is not None else []
        for optimizer in (device.optimizer, getattr(device, "critic_optimizer", None)):
            state = optimizer.state.values() if optimizer is not None else []
            held += [v for s in state for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        assert held and all(t.is_cuda for t in held)
        # The samples' per-token results come back to the host (the trainer keeps them there).
        assert not any(t.is_cuda for t in device.logprobs(test_torch_backend._samples()[:1]))
        weights = {k: v.detach().cpu() for k, v in device.model.named_parameters()}
    # The same kernels on the same data, but for attention: on "cuda" torch takes its math
    # path (in fp32) where the CPU has its own flash kernel, which differ in bf16's last bits.
    # (A step on a copy of the weights, as when an optimizer holds parameters a move replaced,
    # is off by the whole update: 1e-2.)
    atol = 1e-3 if "--bf16" in flags else 1e-5
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-3, abs=atol), key
    for key, value in host.model.named_parameters():
        torch.testing.assert_close(weights[key], value.detach(), atol=atol + 5e-4, rtol=1e-3)


@pytest.mark.parametrize("flags", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_the_offload_round_trip_on_the_simulated_gpu_keeps_every_holder(tiny_model_dir, flags):
    """--offload-train's moves on a device: every parameter (the optimizer's, a tied one, the
    --bf16 masters' hooked ones) goes to pinned host memory and back as the same object, and
    the steps after two round trips are those of a backend never offloaded."""
    samples = test_bf16._samples()
    with simulated_cuda():
        plain = TorchBackend(test_bf16._cfg(*flags), tiny_model_dir, ref_dir=None, total_steps=4)
        want = [plain.train_rollout(samples, 1, it) for it in range(3)]
        moved = TorchBackend(test_bf16._cfg(*flags), tiny_model_dir, ref_dir=None, total_steps=4)
        offload = TrainOffload(moved)
        assert offload.copies
        params = list(moved.model.parameters())
        for it in range(3):
            got = moved.train_rollout(samples, 1, it)
            assert got["grad_norm"] > 0
            for name in ("loss", "grad_norm", "entropy_loss"):
                assert got[name] == pytest.approx(want[it][name], rel=1e-6, abs=1e-7), (it, name)
            if it == 2:
                break
            away = offload.to_host()
            assert away.nbytes > 0 and away.dropped > 0
            assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
            assert list(moved.model.parameters()) == params  # the same objects
            state = [v for s in moved.optimizer.state.values() for v in s.values()]
            assert all(not v.is_cuda for v in state if v.dim() > 0)
            offload.to_device()
            assert all(p.is_cuda and p.grad is None for p in params)
            assert all(p.is_cuda for p in moved.optimizer.param_groups[0]["params"])


def test_a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu(tiny_model_dir, tmp_path):
    """A --bf16 run's checkpoint written on the device, whose optimizer file says "cuda:0" as
    a GPU's torch.save writes it, resumes on the CPU: the next step is the device's."""
    samples = test_bf16._samples()
    with simulated_cuda():
        gpu = TorchBackend(test_bf16._cfg("--bf16"), tiny_model_dir, ref_dir=None, total_steps=4)
        gpu.train_rollout(samples, 1, 0)
        path = checkpoint.save(tmp_path, 1, gpu, {"version": 1}, save_optimizer=True)
        want = gpu.train_rollout(samples, 1, 1)
    with pytest.raises(RuntimeError, match="CUDA device"):  # its tensors were on a GPU
        torch.load(path / OPTIMIZER_FILE, weights_only=True)
    cpu = TorchBackend(test_bf16._cfg("--bf16"), tiny_model_dir, ref_dir=None, total_steps=4)
    cpu.load(path)
    got = cpu.train_rollout(samples, 1, 1)
    for name in ("loss", "grad_norm", "lr"):
        assert got[name] == pytest.approx(want[name], rel=1e-3, abs=1e-3), name
