"""Data parallel training: two gloo ranks take the same step as one rank over the whole
slice, and end with identical weights; samples survive the tensor encoding."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.trainer.backends.distributed import _no_buffer_sync, decode, encode
from millstream.trainer.backends.torch_backend import TorchBackend
from tests.support.redis_server import free_port
from tests.unit.trainer.backends.test_torch_backend import _samples

pytestmark = pytest.mark.timeout(120)

# SGD with lr 1 and no clipping: the weight change IS the gradient, so a sum mistaken for a
# mean shows. (Adam's first step, lr * g / (|g| + eps), would turn float rounding in a
# gradient near eps into a visible change.)
FLAGS = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--optimizer", "sgd",
         "--lr", "1", "--clip-grad", "0"]  # fmt: skip


def build_backend(cfg, model: str) -> TorchBackend:
    critic = model if cfg.algo.uses_critic else None
    if cfg.ckpt.train_backend == "megatron":
        from millstream.trainer.backends.megatron.backend import MegatronBackend

        return MegatronBackend(cfg, model, ref_dir=None, critic_dir=critic, total_steps=2)
    return TorchBackend(cfg, model, ref_dir=None, critic_dir=critic, total_steps=2)


def _batch(uneven: bool) -> list:
    """The test batch; `uneven`: its first sample 5 tokens longer (10), so that packed at 10
    tokens rank 0's share (10 + 3 tokens) takes two micro-batches and rank 1's (4 + 4) one."""
    samples = _samples()
    if uneven:
        first = samples[0]
        samples[0] = dataclasses.replace(
            first, tokens=[*first.tokens, 15, 16, 17, 18, 19], loss_mask=[*first.loss_mask] + [1] * 5,
            rollout_logprobs=[*first.rollout_logprobs] + [-1.0] * 5,
        )  # fmt: skip
    return samples


def _rank(rank: int, world: int, port: int, model: str, out: str,
          runs: list[tuple[list[str], bool]]) -> None:  # fmt: skip
    """One rank of one process group that trains every run in turn (a spawn per run cost
    ~8 s of start-up each)."""
    import torch.distributed as dist

    from millstream.trainer.backends.distributed import DataParallel, init, send_stop, shutdown

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    init()
    try:
        for i, (extra, uneven) in enumerate(runs):
            cfg = parse_run_config([*FLAGS, *extra])
            dp = DataParallel(build_backend(cfg, model))
            if rank == 0:
                metrics = dp.train_rollout(_batch(uneven), cfg.rollout.num_steps_per_rollout)
                torch.save(metrics, Path(out) / f"run{i}-metrics.pt")
                send_stop()
            else:
                dp.follow()
            torch.save(dict(dp.named_weights()), Path(out) / f"run{i}-rank{rank}.pt")
            dist.barrier()
    finally:
        shutdown()


UNEVEN = {"fsdp-uneven-packed"}  # the runs trained on _batch(uneven=True)
RUNS = {
    "per-sample": [],
    "per-token": ["--calculate-per-token-loss"],
    "two-steps": ["--num-steps-per-rollout", "2", "--global-batch-size", "2"],
    "balanced-packed": ["--balance-data", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "6"],
    "reinforce++": ["--advantage-estimator", "reinforce_plus_plus", "--calculate-per-token-loss"],
    "ppo": ["--advantage-estimator", "ppo", "--normalize-advantages"],
    # --train-backend fsdp: the actor sharded (FSDP2); rank 0 holds the gathered weights.
    "fsdp": ["--train-backend", "fsdp"],
    # With the UNEVEN batch rank 0 has two micro-batches and rank 1 one: every forward is a
    # collective, so rank 1 runs an idle round beside rank 0's second (a rank that asked for
    # the count only after its own forwards hung here).
    "fsdp-uneven-packed": ["--train-backend", "fsdp", "--use-dynamic-batch-size",
                           "--max-tokens-per-gpu", "10"],
    "fsdp-balanced-packed": ["--train-backend", "fsdp", "--balance-data",
                             "--use-dynamic-batch-size", "--max-tokens-per-gpu", "6"],
    "fsdp-two-steps-ppo": ["--train-backend", "fsdp", "--num-steps-per-rollout", "2",
                           "--global-batch-size", "2", "--advantage-estimator", "ppo"],
    # --train-backend megatron: megatron's GPTModel as the actor, data parallel through DDP.
    "megatron-balanced-packed": ["--train-backend", "megatron", "--balance-data",
                                 "--use-dynamic-batch-size", "--max-tokens-per-gpu", "6"],
    # Tensor parallel: both ranks train every sample, each its slices of the layers (and of
    # the vocabulary, 259 padded to 260); clipped, the gradient norm must add up the slices.
    "megatron-tp2": ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"],
    "megatron-tp2-packed-clipped": ["--train-backend", "megatron",
                                    "--tensor-model-parallel-size", "2", "--clip-grad", "0.05",
                                    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "6"],
    # Sequence parallel: each rank also takes half of the sequence between the layers
    # (padded to an even length; packed, the padding is a sample of its own).
    "megatron-tp2-sp": ["--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel"],
    "megatron-tp2-sp-packed": ["--train-backend", "megatron", "--tensor-model-parallel-size",
                               "2", "--sequence-parallel", "--use-dynamic-batch-size",
                               "--max-tokens-per-gpu", "7"],
    # Pipeline parallel: one layer on each rank, the embedding on the first and the output
    # layer (the tied embedding's copy) on the second; clipped, the norm adds the stages'.
    "megatron-pp2": ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2"],
    "megatron-pp2-packed-clipped-two-steps": [
        "--train-backend", "megatron", "--pipeline-model-parallel-size", "2", "--clip-grad",
        "0.05", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "6",
        "--num-steps-per-rollout", "2", "--global-batch-size", "2"],
    # Context parallel: each rank a half of every sequence (2 of 4 chunks, padded to a multiple
    # of 4), attending over the whole; packed, the samples' block mask across the halves.
    "megatron-cp2": ["--train-backend", "megatron", "--context-parallel-size", "2"],
    "megatron-cp2-packed-clipped": ["--train-backend", "megatron", "--context-parallel-size",
                                    "2", "--clip-grad", "0.05", "--use-dynamic-batch-size",
                                    "--max-tokens-per-gpu", "7"],
    # PPO: the critic is the torch backend's value model, whole on both ranks.
    "megatron-tp2-ppo": ["--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                         "--advantage-estimator", "ppo", "--normalize-advantages"],
}  # fmt: skip
MEGATRON_ONLY = {"--train-backend": "megatron", "--tensor-model-parallel-size": "2",
                 "--pipeline-model-parallel-size": "2", "--context-parallel-size": "2",
                 "--sequence-parallel": None}  # fmt: skip


def _without_megatron(flags: list[str]) -> list[str]:
    """The same run on the torch backend: megatron's own flags (with their values) left out."""
    out, skip = [], False
    for i, flag in enumerate(flags):
        if skip:
            skip = False
        elif flag in MEGATRON_ONLY and MEGATRON_ONLY[flag] is None:
            continue
        elif flag in MEGATRON_ONLY and i + 1 < len(flags) and flags[i + 1] == MEGATRON_ONLY[flag]:
            skip = True
        else:
            out.append(flag)
    return out


def _train_all(world: int, model: Path, out: Path, runs: dict[str, list[str]]) -> Path:
    """Every run trained by `world` gloo ranks (one spawn); the weights each rank ended with
    are in out/`run{i}-rank{r}.pt`, rank 0's metrics in `run{i}-metrics.pt`."""
    plan = [(flags, name in UNEVEN) for name, flags in runs.items()]
    mp.spawn(_rank, args=(world, free_port(), str(model), str(out), plan), nprocs=world)
    return out


@pytest.fixture(scope="module")
def two_rank_weights(tiny_model_dir, tmp_path_factory) -> Path:
    return _train_all(2, tiny_model_dir, tmp_path_factory.mktemp("ranks"), RUNS)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_take_the_one_rank_step(tiny_model_dir, two_rank_weights, name):
    megatron = "megatron" in RUNS[name]
    # megatron's one-rank step equals the torch backend's (tests/integration/trainer/test_megatron_model.py),
    # which runs here: megatron in this process would patch it and give it a process group.
    flags = _without_megatron(RUNS[name])
    cfg = parse_run_config([*FLAGS, *flags])
    single = build_backend(cfg, str(tiny_model_dir))
    single.train_rollout(_batch(name in UNEVEN), cfg.rollout.num_steps_per_rollout)
    expected = dict(single.named_weights())
    before = load_file(Path(tiny_model_dir) / "model.safetensors")

    i = list(RUNS).index(name)
    ranks = [torch.load(two_rank_weights / f"run{i}-rank{r}.pt", weights_only=True) for r in (0, 1)]
    sharded = "fsdp" in RUNS[name] or any(
        f"--{kind}-parallel-size" in RUNS[name]
        for kind in ("tensor-model", "pipeline-model", "context")
    )
    if sharded:  # rank 0 gathered the full weights; rank 1 keeps only its shards (slices)
        assert ranks[1] == {} and set(ranks[0]) == set(expected)
        ranks = ranks[:1]
    moved = 0
    for key, want in expected.items():
        for got in ranks:
            torch.testing.assert_close(got[key], want, atol=1e-5 if megatron else 1e-6, rtol=0)
        assert torch.equal(ranks[0][key], ranks[-1][key]), key
        moved += int(key in before and not torch.equal(before[key], want))
    assert moved > 0


_MEGATRON = ["--train-backend", "megatron"]
FOUR_RANKS = {
    # Two tensor parallel groups, each training half of the samples (DDP over the data
    # parallel group: ranks 0 and 2, 1 and 3) with half of every layer; clipped at a norm
    # that binds.
    "tp2-dp2": [*_MEGATRON, "--tensor-model-parallel-size", "2", "--clip-grad", "0.05"],
    # The three model parallel kinds two by two on the same four ranks: two pipeline stages
    # of two tensor parallel ranks (sequence parallel between the layers, packed, clipped);
    # two context parallel ranks of two tensor parallel ranks (sequence parallel, packed: real
    # tokens in every rank's slice); two pipeline stages of two context parallel ranks.
    "tp2-pp2": [*_MEGATRON, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                "2", "--sequence-parallel", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
                "7", "--clip-grad", "0.05"],
    "tp2-cp2": [*_MEGATRON, "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                "--sequence-parallel", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "7"],
    "pp2-cp2": [*_MEGATRON, "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                "--use-dynamic-batch-size", "--max-tokens-per-gpu", "7"],
}  # fmt: skip


@pytest.fixture(scope="module")
def four_rank_runs(tiny_model_dir, tmp_path_factory) -> Path:
    return _train_all(4, tiny_model_dir, tmp_path_factory.mktemp("four-ranks"), FOUR_RANKS)


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_ranks_take_the_one_rank_step(tiny_model_dir, four_rank_runs, name):
    """Rank 0 ends with the one-rank weights, and the metrics are the one-rank step's:
    summed over the data parallel ranks, not over the model parallel copies."""
    flags = FOUR_RANKS[name]
    i = list(FOUR_RANKS).index(name)
    single = build_backend(parse_run_config([*FLAGS, *_without_megatron(flags)]),
                           str(tiny_model_dir))  # fmt: skip
    want_metrics = single.train_rollout(_samples(), 1)
    metrics = torch.load(four_rank_runs / f"run{i}-metrics.pt", weights_only=True)
    for metric in ("loss", "grad_norm", "entropy_loss", "ess_ratio", "train_rollout_kl"):
        assert metrics[metric] == pytest.approx(want_metrics[metric], rel=1e-4, abs=1e-6), metric
    ranks = [torch.load(four_rank_runs / f"run{i}-rank{r}.pt", weights_only=True) for r in range(4)]
    assert ranks[1:] == [{}, {}, {}]  # only rank 0 keeps the gathered weights
    before = load_file(Path(tiny_model_dir) / "model.safetensors")
    moved = 0
    for key, want in single.named_weights():
        torch.testing.assert_close(ranks[0][key], want, atol=1e-5, rtol=0)
        moved += int(key in before and not torch.equal(before[key], want))
    assert moved > 0


def test_tensor_parallel_qwen3_q_and_k_norms_take_the_one_rank_step(tmp_path):
    """Qwen3's q/k norms are whole on each tensor parallel rank but see only its heads: their
    gradient is the sum over the group (they drifted apart, and from one rank's step, by
    ~6e-3 before it was). An untied head, GQA, two ranks."""
    from tests.integration.trainer.test_megatron_model import _qwen3_untied

    model = str(_qwen3_untied(tmp_path / "qwen3"))
    flags = ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"]
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_rank, args=(2, free_port(), model, str(out), [(flags, False)]), nprocs=2)
    single = build_backend(parse_run_config(FLAGS), model)
    single.train_rollout(_samples(), 1)
    got = torch.load(out / "run0-rank0.pt", weights_only=True)
    norms = [k for k in got if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4
    before = load_file(Path(model) / "model.safetensors")
    for key, want in single.named_weights():
        torch.testing.assert_close(got[key], want, atol=1e-5, rtol=0)
    assert all(not torch.equal(got[k], before[k]) for k in norms)


# Adam with eps 1: its update is smooth in the gradient (see FLAGS), and has state to shard.
ADAM = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--optimizer", "adam",
        "--lr", "1", "--adam-eps", "1", "--clip-grad", "0"]  # fmt: skip
# Each rank holds optimizer state of its own: FSDP's shards, megatron's tensor parallel slices
# and pipeline stages.
SHARDED = {"fsdp": ["--train-backend", "fsdp"],
           "megatron-tp2": ["--train-backend", "megatron", "--tensor-model-parallel-size", "2"],
           "megatron-pp2": ["--train-backend", "megatron", "--pipeline-model-parallel-size", "2"],
           "megatron-cp2": ["--train-backend", "megatron", "--context-parallel-size", "2"]}  # fmt: skip


def _resume_rank(rank: int, world: int, port: int, model: str, out: str, runs: dict) -> None:
    """For each run (one spawn for all), in out/<name>/: train one rollout sharded, save
    (each rank its optimizer shard), build again from the checkpoint as a resumed run does,
    train a second rollout; rank 0 keeps the weights."""
    import torch.distributed as dist

    from millstream.trainer.backends.distributed import init, shutdown

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    init()
    try:
        for name, flags in runs.items():
            _resume_run(rank, model, Path(out) / name, flags)
            dist.barrier()
    finally:
        shutdown()


def _resume_run(rank: int, model: str, out: Path, flags: list[str]) -> None:
    from millstream.trainer.backends.distributed import DataParallel, send_stop

    cfg = parse_run_config([*ADAM, *flags])
    ckpt = out / "ckpt"
    for resumed in (False, True):
        backend = build_backend(cfg, model)
        if resumed:
            backend.load_weights(ckpt)
        dp = DataParallel(backend)
        if resumed:
            dp.load(ckpt)
        if rank == 0:
            dp.train_rollout(_samples(), 1)
            if not resumed:
                ckpt.mkdir(parents=True)
                dp.save(ckpt)
            send_stop()
        else:
            dp.follow()
    if rank == 0:
        torch.save(dict(dp.named_weights()), out / "resumed.pt")
    if "megatron" in flags:
        # The torch_dist files of the first rollout, read by one model parallel rank (two
        # data parallel ranks): resharded, the vocabulary's padding (TP: 260 rows) undone,
        # the stages' layers (PP) in one model.
        one = build_backend(parse_run_config([*ADAM, "--train-backend", "megatron"]), model)
        one.load_weights(ckpt)
        if rank == 0:
            torch.save(dict(one.named_weights()), out / "resharded.pt")


@pytest.fixture(scope="module")
def resumed_runs(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resumed")
    mp.spawn(_resume_rank, args=(2, free_port(), str(tiny_model_dir), str(out), SHARDED),
             nprocs=2)  # fmt: skip
    return out


@pytest.mark.parametrize("name", list(SHARDED))
def test_a_sharded_run_saves_hf_weights_and_optimizer_shards_and_resumes_from_them(
    tiny_model_dir, resumed_runs, name
):
    flags, out = SHARDED[name], resumed_runs / name
    # One rank, from the same weights: the torch backend (megatron's equals it: above).
    cfg = parse_run_config([*ADAM, *_without_megatron(flags)])
    tol = 1e-5 if "megatron" in name else 1e-6
    single = build_backend(cfg, str(tiny_model_dir))
    single.train_rollout(_samples(), 1)
    after_one = {key: value.clone() for key, value in single.named_weights()}
    single.train_rollout(_samples(), 1)
    ckpt = out / "ckpt"
    assert sorted(p.name for p in ckpt.glob("optimizer*")) == [
        "optimizer.rank0.pt",
        "optimizer.rank1.pt",
    ]
    # The weights are a Hugging Face checkpoint any one rank reads ...
    reader = build_backend(cfg, str(tiny_model_dir))
    reader.load_weights(ckpt)
    for key, value in reader.named_weights():
        torch.testing.assert_close(value, after_one[key], atol=tol, rtol=0)
    # ... but the optimizer state resumes only sharded as it was saved.
    with pytest.raises(MillstreamError, match="sharded over 2 ranks"):
        reader.load(ckpt)
    resumed = torch.load(out / "resumed.pt", weights_only=True)
    for key, want in single.named_weights():
        torch.testing.assert_close(resumed[key], want, atol=tol, rtol=0)
    if "megatron" in name:  # and megatron's torch_dist files beside them, which it resumed from
        assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        resharded = torch.load(out / "resharded.pt", weights_only=True)
        assert set(resharded) == set(after_one)
        for key, value in resharded.items():
            torch.testing.assert_close(value, after_one[key], atol=tol, rtol=0)


def test_samples_cross_as_tensors_unchanged():
    samples = _samples()
    assert decode(encode(samples)) == samples
    distilled = [
        dataclasses.replace(
            s, teacher_logprobs=[-0.5 - i] * s.response_len, behavior_version=7 + i, version_lag=i
        )
        for i, s in enumerate(samples)
    ]
    assert decode(encode(distilled)) == distilled
    assert decode(encode([])) == []


def test_several_trainer_ranks_without_torchrun_say_how_to_start_them(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from millstream.trainer.main import train

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(prompts),
            "--input-key", "prompt", "--rm-type", "exact", "--num-rollout", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--actor-num-gpus-per-node", "2", "--wandb-key", "s3cret", "--admin-token=t0ken",
            "--redis-url", "redis://:pw@127.0.0.1:1/0"]  # fmt: skip
    assert train(argv) == 2
    err = capsys.readouterr().err
    assert "torchrun --nnodes 1 --nproc-per-node 2 -m millstream.cli train --hf-checkpoint" in err
    # The hint echoes the command line, never its secrets.
    assert "--input-key prompt" in err and "--wandb-key *** --admin-token=***" in err
    assert "s3cret" not in err and "t0ken" not in err and ":pw@" not in err


def test_the_buffer_switch_takes_the_name_this_torch_knows():
    """torch 2.13 renamed DDP's `broadcast_buffers` to `forward_sync_buffers`; torch 2.11, the
    GPU image's, refuses the new name (a TypeError at every data-parallel start, seen in the
    CPU rehearsal of that image). The name chosen must be one DDP here accepts."""
    from torch.nn.parallel import DistributedDataParallel

    class Torch211DDP:  # the 2.11 signature, as far as the switch goes
        def __init__(self, module, device_ids=None, broadcast_buffers=True, process_group=None):
            pass

    assert _no_buffer_sync(Torch211DDP) == {"broadcast_buffers": False}
    (name,) = _no_buffer_sync(DistributedDataParallel)
    assert name in inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        assert name == "forward_sync_buffers"  # not the deprecated one where both exist
