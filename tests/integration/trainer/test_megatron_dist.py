"""Megatron's torch_dist checkpoints: `millstream convert` both ways, and the Megatron backend
starting from a torch_dist --load and --ref-load (megatron/dist.py). A save by two tensor
parallel ranks read by one, and a run's resume from its own: tests/integration/trainer/test_data_parallel.py;
a torchrun run from a converted --ref-load: tests/e2e/test_train_ddp.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from tests.integration.trainer.test_megatron_model import _qwen3_untied
from tests.support.redis_server import free_port

pytestmark = pytest.mark.timeout(180)


def _convert(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "millstream.cli", "convert", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_convert_hf_to_torch_dist_and_back_gives_the_same_weights(tmp_path):
    """A Qwen3 with q/k norms and an untied head through torch_dist and back, bit for bit;
    the torch_dist file holds megatron's names (layers stacked, the norms under Transformer
    Engine's names) as Miles' converter writes them."""
    from torch.distributed.checkpoint import FileSystemReader

    model = _qwen3_untied(tmp_path / "qwen3")
    root, back = tmp_path / "qwen3_torch_dist", tmp_path / "qwen3_hf"
    proc = _convert("hf-to-torch-dist", "--hf-checkpoint", str(model), "--save", str(root),
                    "--num-layers", "2", "--qk-layernorm", "--untie-embeddings-and-output-weights")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    stored = FileSystemReader(str(root / "release")).read_metadata().state_dict_metadata
    assert tuple(stored["decoder.layers.self_attention.linear_qkv.layer_norm_weight"].size) == (
        2,
        64,
    )
    assert tuple(stored["decoder.layers.self_attention.q_layernorm.weight"].size) == (2, 24)
    assert tuple(stored["output_layer.weight"].size) == (97, 64)
    proc = _convert("torch-dist-to-hf", "--input-dir", str(root), "--output-dir", str(back),
                    "--origin-hf-dir", str(model))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = load_file(model / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert (back / "config.json").is_file()


def test_convert_refuses_model_flags_that_disagree_with_the_config(tiny_model_dir, tmp_path):
    proc = _convert("hf-to-torch-dist", "--hf-checkpoint", str(tiny_model_dir),
                    "--save", str(tmp_path / "out"), "--num-layers", "7")  # fmt: skip
    assert proc.returncode == 2
    assert "--num-layers 7 disagrees with the model" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    proc = _convert("torch-dist-to-hf", "--input-dir", str(tmp_path), "--output-dir",
                    str(tmp_path / "hf"), "--origin-hf-dir", str(tiny_model_dir))  # fmt: skip
    assert proc.returncode == 1
    assert f"--input-dir {tmp_path} holds no torch_dist checkpoint" in proc.stderr


def _start_from_torch_dist(rank: int, port: int, model_dir: str, out: str, other: str) -> None:
    """Two torch_dist checkpoints of other weights (as Megatron saves one and Miles' converter
    makes one), then a backend started from them as a Miles script starts: --load and
    --ref-load with a KL term; and one of them read into another model (`other`)."""
    import torch.distributed as dist

    from millstream.common.config import parse_run_config
    from millstream.common.errors import MillstreamError
    from millstream.trainer.backends.megatron import dist as megatron_dist
    from millstream.trainer.backends.megatron.backend import MegatronBackend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    flags = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--train-backend",
             "megatron", "--use-kl-loss"]  # fmt: skip
    made = {}
    for name, tracker in (("load", "20"), ("ref", "release")):
        backend = MegatronBackend(parse_run_config(flags), model_dir, ref_dir=None, total_steps=1)
        torch.manual_seed(len(made))
        with torch.no_grad():
            for param in backend.model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        root = Path(out) / name
        megatron_dist.save(
            backend.model, root / ("release" if tracker == "release" else "iter_0000020")
        )
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
        made[name] = {k: v.clone() for k, v in backend.gather_weights().items()}
    cfg = parse_run_config([*flags, "--load", str(Path(out) / "load"), "--ref-load",
                            str(Path(out) / "ref")])  # fmt: skip
    started = MegatronBackend(cfg, model_dir, ref_dir=model_dir, total_steps=1)
    qwen3 = MegatronBackend(parse_run_config(flags), other, ref_dir=None, total_steps=1)
    try:
        megatron_dist.load(qwen3.model, started.start_checkpoint, qwen3.hf.config)
        refused = ""
    except MillstreamError as err:
        refused = str(err)
    torch.save(
        {"made": made, "actor": dict(started.named_weights()),
         "ref": started.ref.state_dict(), "refused": refused, "start": str(started.start_checkpoint)},
        Path(out) / "started.pt",
    )  # fmt: skip
    dist.destroy_process_group()


def test_the_megatron_backend_starts_from_a_torch_dist_load_and_ref_load(tiny_model_dir, tmp_path):
    """--load's weights are the actor's, --ref-load's the reference's; another model's
    checkpoint is named as one, with the first tensors that differ."""
    other = _qwen3_untied(tmp_path / "qwen3")
    args = (free_port(), str(tiny_model_dir), str(tmp_path), str(other))
    mp.spawn(_start_from_torch_dist, args=args, nprocs=1)
    got = torch.load(tmp_path / "started.pt", weights_only=True)
    assert got["refused"].startswith(
        f"the torch_dist checkpoint {tmp_path / 'load' / 'iter_0000020'} is not this model's"
    ), got["refused"]
    assert "give the --hf-checkpoint it was made from" in got["refused"]
    made = got["made"]
    assert got["start"] == str(tmp_path / "load" / "iter_0000020")
    for key, value in made["load"].items():  # the actor: --load's
        assert torch.equal(got["actor"][key], value), key
        assert not torch.equal(made["ref"][key], value), key
    for key, value in made["ref"].items():  # the reference: --ref-load's
        assert torch.equal(got["ref"][key], value), key
