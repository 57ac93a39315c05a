"""The Megatron backend's model (issue 15, its first part): megatron-core's GPTModel built from
a Hugging Face config on this CPU, given the HF weights, computes the HF model's logits; the
weight conversion goes both ways unchanged. Each check runs in a process of its own (megatron
needs a process group and its parallel state, and the CPU patches are process-wide)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.support.redis_server import free_port

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(180)


def _qwen3_untied(directory: Path) -> Path:
    """A random Qwen3 (q/k norms, untied head): the other layout the conversion handles."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
        max_position_embeddings=64,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


def _check(rank: int, port: int, model_dirs: list[str]) -> None:
    import megatron.core  # noqa: F401
    import torch.distributed as dist

    from millstream.trainer.backends.megatron import cpu as megatron_cpu
    from millstream.trainer.backends.megatron import model as megatron_model  # noqa: F401

    # Imported, megatron and the backend's modules have patched nothing yet.
    assert getattr(torch.cuda.current_device, "__name__", "") == "current_device", "patched"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with megatron_cpu.model_parallel():
            for model_dir in model_dirs:
                _check_one(model_dir)
    finally:
        dist.destroy_process_group()


def _check_one(model_dir: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from millstream.trainer.backends.megatron import model as megatron_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a GPU run too
    hf_config = AutoConfig.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    model = megatron_model.build(hf_config).eval().to(device)
    state = megatron_model.shard(
        megatron_model.hf_to_megatron(hf.state_dict(), hf_config), model, 1, 0
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert [m for m in missing if not m.endswith("_extra_state")] == [] and not unexpected
    ids = torch.randint(
        0, hf_config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)
    ).to(device)
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = megatron_model.logits(model, ids)
    # fp32 on both sides, the same ops in another order: agreement to float rounding
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    back = megatron_model.megatron_to_hf(
        {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")},
        hf_config,
    )
    hf_state = {k: v for k, v in hf.state_dict().items()
                if not (hf_config.tie_word_embeddings and k == "lm_head.weight")}  # fmt: skip
    assert set(back) == set(hf_state)
    for key, value in hf_state.items():
        assert torch.equal(back[key], value), key


def test_megatron_gpt_model_computes_the_hf_logits_qwen2_tied_and_qwen3_untied(
    tiny_model_dir, tmp_path
):
    """In one process (megatron's import is seconds): the CPU patches wait for the model to be
    built; then the tied Qwen2 with QKV bias and the untied Qwen3 with q/k norms."""
    dirs = [str(tiny_model_dir), str(_qwen3_untied(tmp_path / "qwen3"))]
    mp.spawn(_check, args=(free_port(), dirs), nprocs=1)


# -- the backend: the torch backend's training with megatron's GPTModel as the actor ----------

FLAGS = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--optimizer", "sgd",
         "--lr", "1", "--clip-grad", "0", "--use-kl-loss", "--kl-loss-coef", "0.1"]  # fmt: skip
LAYOUTS = {"padded": [], "packed": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "9"],
           # activation recomputation: the same step (megatron recomputes, torch ignores it)
           "recompute-full": ["--recompute-granularity", "full", "--recompute-method",
                              "uniform", "--recompute-num-layers", "1"],
           "recompute-selective": ["--recompute-granularity", "selective"],
           # the estimators and objective flags, through the shared loss code
           "gspo": ["--advantage-estimator", "gspo"],
           "reinforce++-kl-in-reward": ["--advantage-estimator", "reinforce_plus_plus",
                                        "--use-kl-in-reward", "--kl-coef", "0.05"],
           "rloo-per-token": ["--advantage-estimator", "reinforce_plus_plus_baseline",
                              "--calculate-per-token-loss"],
           "tis-entropy-clip-higher": ["--use-tis", "--entropy-coef", "0.01", "--eps-clip-high",
                                       "0.28", "--kl-loss-type", "low_var_kl"],
           "ppo": ["--advantage-estimator", "ppo"]}  # fmt: skip

# Layouts whose step differs from GRPO's on this batch. GSPO's does not: with one on-policy
# step its sequence ratio is 1 and its gradient is GRPO's sample-mean one. Nor does PPO's
# actor step: the fresh critic's values are 0, so its advantages are the rewards, +-1 as
# GRPO's are here.
ESTIMATOR_LAYOUTS = ("reinforce++-kl-in-reward", "rloo-per-token", "tis-entropy-clip-higher")


def _backend_step(rank: int, model_dir: str, out: str) -> None:
    """In its own process: for each layout, one rollout on the torch backend and on the
    Megatron backend from the same weights; the logprobs before and the weights after, in
    Hugging Face names; then the Megatron backend's checkpoint written and read back."""
    from millstream.common.config import parse_run_config
    from millstream.trainer.backends.megatron.backend import MegatronBackend
    from millstream.trainer.backends.torch_backend import TorchBackend
    from tests.unit.trainer.backends.test_torch_backend import _samples

    results = {}
    for name, flags in LAYOUTS.items():
        cfg = parse_run_config([*FLAGS, *flags])
        pair = {}
        for kind, cls in (("torch", TorchBackend), ("megatron", MegatronBackend)):
            critic = model_dir if cfg.algo.uses_critic else None  # PPO: an HF value model
            backend = cls(cfg, model_dir, ref_dir=model_dir, critic_dir=critic, total_steps=2)
            if kind == "megatron" and name.startswith("recompute"):
                granularity = backend.model.config.recompute_granularity
                assert granularity == name.removeprefix("recompute-"), granularity
            before = backend.logprobs(_samples())
            backend.train_rollout(_samples(), 1)
            pair[kind] = (before, {k: v.cpu().clone() for k, v in backend.named_weights()})
        results[name] = pair
        if name == "padded":
            ckpt = Path(out) / "ckpt"
            ckpt.mkdir()
            backend.save(ckpt)
            reread = MegatronBackend(cfg, model_dir, ref_dir=None, total_steps=2)
            reread.load(ckpt)
            results["reread"] = {k: v.cpu().clone() for k, v in reread.named_weights()}
    torch.save(results, Path(out) / "results.pt")


def test_the_megatron_backend_takes_the_torch_backends_step(tiny_model_dir, tmp_path):
    """Same weights and batch: the same logprobs before, the same weights after one step
    (with a KL term to a Hugging Face reference), padded and packed, with recomputation, and
    for each estimator and objective flag (GSPO, REINFORCE++ with the KL in the reward, its
    baseline variant with a per-token loss, TIS with an entropy bonus and clip-higher, PPO
    with its critic); its
    checkpoint is a Hugging Face one that reads back unchanged."""
    mp.spawn(_backend_step, args=(str(tiny_model_dir), str(tmp_path)), nprocs=1)
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    for name in LAYOUTS:
        (torch_before, torch_after), (mega_before, mega_after) = (
            results[name]["torch"],
            results[name]["megatron"],
        )
        for want, got in zip(torch_before, mega_before, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert set(mega_after) == set(torch_after)
        for key, want in torch_after.items():
            torch.testing.assert_close(mega_after[key], want, atol=1e-5, rtol=1e-4)
        initial = load_file(Path(tiny_model_dir) / "model.safetensors")
        assert any(not torch.equal(initial[k], v) for k, v in mega_after.items()), "no step"
    for key, want in results["padded"]["megatron"][1].items():
        assert torch.equal(results["reread"][key], want), key
    grpo = results["padded"]["torch"][1]
    for name in ESTIMATOR_LAYOUTS:  # each flag changed the step (so the equality says something)
        after = results[name]["torch"][1]
        assert any(not torch.equal(after[k], grpo[k]) for k in grpo), name


def test_a_model_with_output_projection_or_mlp_bias_is_refused_not_built_without_it():
    """Megatron's linear layers here have no bias but QKV's: a Llama with attention_bias
    (q, k, v and o_proj) or mlp_bias would lose weights in the conversion."""
    from transformers import LlamaConfig

    from millstream.common.errors import MillstreamError
    from millstream.trainer.backends.megatron import model as megatron_model

    for bias in ({"attention_bias": True}, {"mlp_bias": True}):
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, **bias)
        with pytest.raises(MillstreamError, match=r"attention_bias .* or mlp_bias"):
            megatron_model.transformer_config(config)


# -- --use-distributed-optimizer: megatron's optimizer on a GPU, the plain one on CPU ------------

DIST_OPT_FLAGS = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--lr", "1e-2",
                  "--clip-grad", "0.05", "--lr-warmup-iters", "2", "--weight-decay", "0.1",
                  "--use-distributed-optimizer"]  # fmt: skip


def _distributed_optimizer_steps(rank: int, model_dir: str, out: str) -> None:
    """In its own process: two rollouts on the torch backend, on the Megatron backend with
    megatron's distributed optimizer, and on one that resumes from the latter's checkpoint
    after the first; every actor's weights after each rollout, and the logged step rows."""
    from millstream.common.config import parse_run_config
    from millstream.trainer.backends.megatron import optimizer as megatron_optimizer
    from millstream.trainer.backends.megatron.backend import MegatronBackend
    from millstream.trainer.backends.torch_backend import TorchBackend
    from tests.unit.trainer.backends.test_torch_backend import _samples

    cfg = parse_run_config(DIST_OPT_FLAGS)
    results: dict = {}
    backends = {"torch": TorchBackend(cfg, model_dir, ref_dir=None, total_steps=4),
                "megatron": MegatronBackend(cfg, model_dir, ref_dir=None, total_steps=4)}  # fmt: skip
    assert isinstance(backends["megatron"].optimizer, megatron_optimizer.Optimizer)
    for rollout in range(2):
        for kind, backend in list(backends.items()):
            metrics = backend.train_rollout(_samples(), 1)
            weights = {k: v.detach().cpu().clone() for k, v in backend.named_weights()}
            results[f"{kind}/{rollout}"] = (metrics, weights)
        if rollout == 0:
            ckpt = Path(out) / "ckpt"
            ckpt.mkdir()
            backends["megatron"].save(ckpt)
            resumed = MegatronBackend(cfg, model_dir, ref_dir=None, total_steps=4)
            resumed.load(ckpt)
            backends["resumed"] = resumed
    torch.save(results, Path(out) / "results.pt")


@pytest.mark.gpu  # megatron's distributed optimizer needs a GPU
def test_the_distributed_optimizer_takes_the_torch_backends_steps_and_resumes(
    tiny_model_dir, tmp_path
):
    """On a GPU: megatron's DistributedDataParallel and distributed optimizer take the torch
    backend's AdamW steps (weight decay on every parameter, the warmup schedule, the clipped
    norm), and a backend resumed from its checkpoint (Adam's moments and the schedule) takes
    the same second step."""
    mp.spawn(_distributed_optimizer_steps, args=(str(tiny_model_dir), str(tmp_path)), nprocs=1)
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    differences = {}  # each run's largest weight difference from the torch backend's
    for rollout in range(2):
        want_metrics, want = results[f"torch/{rollout}"]
        for kind in ("megatron", "resumed") if rollout else ("megatron",):
            metrics, got = results[f"{kind}/{rollout}"]
            assert set(got) == set(want)
            differences[f"{kind}/{rollout}"] = max(
                float((got[key] - value).abs().max()) for key, value in want.items()
            )
            for name in ("grad_norm", "lr", "loss"):
                assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-4), (kind, name)
    assert max(differences.values()) < 1e-5, differences
    assert results["torch/0"][0]["grad_norm"] > 0.05  # so the step was clipped
    assert results["torch/0"][0]["lr"] < results["torch/1"][0]["lr"]  # warming up


def test_use_distributed_optimizer_on_cpu_keeps_the_plain_optimizer(tiny_model_dir):
    """Without a GPU the flag is taken and said to do nothing here, not refused: a Miles
    script that passes it runs on this CPU with the plain optimizer (the same step)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    mp.spawn(_plain_optimizer_on_cpu, args=(str(tiny_model_dir),), nprocs=1)


def _plain_optimizer_on_cpu(rank: int, model_dir: str) -> None:
    import logging

    from millstream.common.config import parse_run_config
    from millstream.trainer.backends.megatron.backend import MegatronBackend

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("millstream.trainer.backends.megatron.backend").addHandler(handler)
    backend = MegatronBackend(parse_run_config(DIST_OPT_FLAGS), model_dir, ref_dir=None,
                              total_steps=2)  # fmt: skip
    assert not backend.distributed_optimizer
    assert isinstance(backend.optimizer, torch.optim.AdamW)
    assert any("needs a GPU" in r.getMessage() for r in records), records
