"""`millstream convert`: Hugging Face <-> Megatron torch_dist checkpoints, as Miles' tools do.

    millstream convert hf-to-torch-dist --hf-checkpoint HF_DIR --save ROOT [MODEL_ARGS...]
        writes ROOT/release/ (torch_dist) and ROOT/latest_checkpointed_iteration.txt saying
        "release", what Miles' tools/convert_hf_to_torch_dist.py writes: a --ref-load (or
        --load) for `millstream train --train-backend megatron` and for Miles' Megatron.
        Model flags given (a Miles script's MODEL_ARGS) must agree with HF_DIR's config.json,
        as `millstream train` checks them.
    millstream convert torch-dist-to-hf --input-dir CKPT --output-dir OUT --origin-hf-dir HF_DIR
        CKPT: a torch_dist dir (release/, iter_N/: ours or Megatron-LM's) or the root above
        it (its tracker names which); OUT gets HF_DIR's config and tokenizer files and the
        weights in Hugging Face names and HF_DIR's dtype, what
        tools/convert_torch_dist_to_hf.py does.

One process, one rank, on CPU: a torch_dist checkpoint does not depend on the parallel layout
(a run with any tensor parallel size reads what this writes, megatron/dist.py). The model is
megatron_model's GPTModel for HF_DIR's config (Qwen2, Qwen3, Llama).
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from millstream.common.config import ConfigError
from millstream.common.errors import MillstreamError

from . import atomic, megatron_ckpt

_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="millstream convert", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="direction", required=True)
    to_dist = sub.add_parser("hf-to-torch-dist", help="a Hugging Face model dir to torch_dist")
    to_dist.add_argument("--hf-checkpoint", required=True, help="the Hugging Face model dir")
    to_dist.add_argument("--save", required=True, help="the root to write release/ under")
    to_hf = sub.add_parser("torch-dist-to-hf", help="a torch_dist checkpoint to Hugging Face")
    to_hf.add_argument("--input-dir", required=True, help="the torch_dist dir, or its root")
    to_hf.add_argument("--output-dir", required=True, help="the Hugging Face dir to write")
    to_hf.add_argument(
        "--origin-hf-dir", required=True, help="the model's Hugging Face dir: config, tokenizer"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(list(argv))
    if args.direction == "hf-to-torch-dist":
        _check_model_args(parser, args.hf_checkpoint, rest)
        hf_to_torch_dist(Path(args.hf_checkpoint), Path(args.save))
    else:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        torch_dist_to_hf(Path(args.input_dir), Path(args.output_dir), Path(args.origin_hf_dir))
    return 0


def _check_model_args(parser: argparse.ArgumentParser, hf_dir: str, rest: list[str]) -> None:
    """Flags beside --hf-checkpoint may be a Miles script's MODEL_ARGS: parsed as the trainer
    parses them (another flag exits 2 naming it) and matched against the config.json."""
    if not Path(hf_dir, "config.json").is_file():
        parser.error(f"--hf-checkpoint {hf_dir} is not a Hugging Face model dir (no config.json)")
    if not rest:
        return
    from millstream.common.config import parse_run_config, refusals

    # A batch size only for the run config's own rule (four knobs); the flags given win.
    argv = ["--rollout-batch-size", "1", *rest, "--hf-checkpoint", hf_dir]
    cfg = parse_run_config(argv, prog="millstream convert hf-to-torch-dist")
    try:
        refusals.check_model(cfg)
    except ConfigError as err:
        parser.error(str(err))


def _model(hf_dir: Path) -> tuple[Any, Any]:
    """(HF config, GPTModel with random weights) on a one-rank group, tensor parallel 1."""
    from transformers import AutoConfig

    from ..backends.megatron import model as megatron_model
    from ..backends.megatron.backend import init_model_parallel, one_rank_group

    one_rank_group()
    init_model_parallel(1)
    config = AutoConfig.from_pretrained(hf_dir)
    return config, megatron_model.build(config)


def hf_to_torch_dist(hf_dir: Path, root: Path) -> Path:
    """HF_DIR's weights as ROOT/release/ in torch_dist, the tracker saying "release"."""
    from transformers import AutoModelForCausalLM

    from ..backends.megatron import dist as megatron_dist
    from ..backends.megatron import model as megatron_model

    start = time.monotonic()
    config, model = _model(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32")
    state = megatron_model.shard(
        megatron_model.hf_to_megatron(hf.state_dict(), config), model, 1, 0
    )
    megatron_model.load_into(model, state, f"--hf-checkpoint {hf_dir}")
    out = root / "release"
    atomic.recover(root)  # a killed conversion's temp dir: never read, removed
    if out.exists():
        raise MillstreamError(f"--save {root}: {out} exists already; give an empty dir")
    # Whole or absent, as a run's checkpoints: a killed conversion leaves no release/
    atomic.write_dir(out, lambda tmp: megatron_dist.save(model, tmp))
    atomic.write_text(root / megatron_ckpt.TRACKER, "release")
    n = sum(p.numel() for p in model.parameters())
    print(f"[convert] {hf_dir} -> {out} (torch_dist, {n / 1e6:.2f}M parameters) in "
          f"{time.monotonic() - start:.1f}s", flush=True)  # fmt: skip
    return out


def torch_dist_to_hf(input_dir: Path, output_dir: Path, origin: Path) -> Path:
    """The torch_dist checkpoint at INPUT_DIR as a Hugging Face model dir: ORIGIN's files but
    its weights, and the checkpoint's weights in ORIGIN's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..backends.megatron import dist as megatron_dist
    from ..backends.megatron import model as megatron_model

    start = time.monotonic()
    source = megatron_ckpt.checkpoint_dir(input_dir)
    if not megatron_dist.is_torch_dist(source):
        raise MillstreamError(f"--input-dir {input_dir} holds no torch_dist checkpoint")
    if not (origin / "config.json").is_file():
        raise MillstreamError(f"--origin-hf-dir {origin} is not a Hugging Face model dir")
    if output_dir.exists() and any(output_dir.iterdir()):
        raise MillstreamError(f"--output-dir {output_dir} is not empty")
    config, model = _model(origin)
    megatron_dist.load(model, source, config)
    whole = megatron_model.unshard(model, config, 1, lambda t: [t])
    weights = megatron_model.megatron_to_hf(whole, config)
    dtype = getattr(config, "dtype", None) or torch.float32
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise MillstreamError(f"{source}: the weights do not fit {origin}'s model ({missing[:3]})")
    weight_files = {p for pattern in _WEIGHT_FILES for p in origin.glob(pattern)}

    def fill(out: Path) -> None:
        hf.to(dtype).save_pretrained(out, safe_serialization=True)
        for path in origin.iterdir():  # tokenizer, generation config, chat template, ...
            if path.is_file() and path not in weight_files and not (out / path.name).exists():
                shutil.copy2(path, out / path.name)

    atomic.write_dir(output_dir, fill)  # whole or absent: a killed conversion leaves none
    print(f"[convert] {source} -> {output_dir} (Hugging Face, {dtype}) in "
          f"{time.monotonic() - start:.1f}s", flush=True)  # fmt: skip
    return output_dir
