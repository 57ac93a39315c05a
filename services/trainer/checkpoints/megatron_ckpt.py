"""Recognise a Megatron checkpoint where a Hugging Face model dir or our own checkpoint is
wanted, so preflight names the flag, the format and the fix (`millstream convert`, or
--train-backend megatron, which reads torch_dist: megatron/dist.py) instead of a missing
config.json.

Miles scripts pass Megatron dirs: `--ref-load /root/Qwen3-4B_torch_dist` (made by Miles'
tools/convert_hf_to_torch_dist.py) and `--load /root/Qwen3-4B_miles/` (saved by its Megatron
backend). Detection is by layout alone, never by reading a tensor:

    ROOT/latest_checkpointed_iteration.txt    "release" (a converted model) or an iteration
    ROOT/release/  or  ROOT/iter_0000020/     the checkpoint the tracker names, holding
        .metadata, __0_0.distcp, ...          torch.distributed.checkpoint's files (torch_dist)
        metadata.json                         megatron-core's {"sharded_backend": ...}
        common.pt                             the unsharded objects
        mp_rank_00/model_optim_rng.pt         the legacy `torch` format, one dir per rank

A checkpoint dir is Megatron's when it holds `.metadata`, a `*.distcp` file, a megatron-core
`metadata.json` (a `sharded_backend` key) or an `mp_rank_*` dir, and no `trainer_state.json`
(millstream's own iter_N/ has that, with model/ in Hugging Face format: checkpoints/checkpoint.py). The dir
looked at is ROOT itself (an iter dir given directly), the one the tracker names, else the
newest iter_*/ or release/ under ROOT.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
OUR_STATE = "trainer_state.json"  # checkpoint.py STATE
ITER = re.compile(r"iter_\d+")


def _sharded_backend(path: Path) -> str | None:
    """megatron-core's metadata.json (dist_checkpointing CheckpointingConfig): its backend."""
    try:
        data = json.loads((path / "metadata.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    return backend if isinstance(backend, str) else None


def _format_of(path: Path) -> tuple[str, str] | None:
    """(format, what shows it) when `path` is one Megatron checkpoint dir, else None."""
    if not path.is_dir() or (path / OUR_STATE).exists():
        return None
    try:
        names = sorted(os.listdir(path))
    except OSError:  # unreadable: the caller's own check says so
        return None
    distcp = [n for n in names if n.endswith(".distcp")]
    backend = _sharded_backend(path)
    found = [n for n in (".metadata", "metadata.json", "common.pt") if n in names]
    if distcp:
        found.append(f"{len(distcp)} *.distcp file{'s' if len(distcp) > 1 else ''}")
    if distcp or ".metadata" in names or backend:
        return f"Megatron {backend or 'torch_dist'}", ", ".join(found)
    ranks = [n for n in names if n.startswith("mp_rank_") and (path / n).is_dir()]
    if ranks:
        return "Megatron torch (legacy)", f"{ranks[0]}/" + (
            f" and {len(ranks) - 1} more" if len(ranks) > 1 else ""
        )
    return None


def _named_dir(root: Path) -> tuple[Path, str] | None:
    """The checkpoint dir under `root` the tracker names (or the newest there), and how."""
    tracker = root / TRACKER
    if tracker.is_file():
        try:
            text = tracker.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            text = ""
        name = (
            "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
        )
        if name:
            return root / name, f"{TRACKER} says {text}, {name}/ holds"
    # iter_N/ exactly: never a killed save's temp dir or a moved-aside copy (atomic.py)
    subdirs = sorted(p for p in root.glob("iter_*") if p.is_dir() and ITER.fullmatch(p.name))
    candidates = ([root / "release"] if (root / "release").is_dir() else []) + subdirs[::-1]
    return (candidates[0], f"{candidates[0].name}/ holds") if candidates else None


def describe(path: str | os.PathLike[str]) -> str | None:
    """'a Megatron torch_dist checkpoint (...)' when `path` is one (the root a Miles script
    passes, or an iter dir in it), else None: a Hugging Face dir, ours, or nothing there."""
    root = Path(path)
    if not root.is_dir():
        return None
    here = _format_of(root)
    if here:
        return f"a {here[0]} checkpoint ({here[1]})"
    named = _named_dir(root)
    if named is None:
        return None
    found = _format_of(named[0])
    return f"a {found[0]} checkpoint ({named[1]} {found[1]})" if found else None


def checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The dir holding the checkpoint's files: `path` itself (an iter dir given directly), or
    the one its tracker names (the newest iter_*/ or release/ without one)."""
    root = Path(path)
    if _format_of(root) is None and (named := _named_dir(root)) is not None:
        return named[0]
    return root


def torch_dist_dir(path: str | os.PathLike[str] | None) -> Path | None:
    """The dir of torch_dist files that `path` names (it, or the one its tracker names), when
    `path` is a Megatron torch_dist checkpoint (not ours); else None."""
    if not path:
        return None
    found = describe(path)
    return checkpoint_dir(path) if found and "torch_dist" in found else None


def message(flag: str, path: str, found: str, hf_checkpoint: str | None) -> str:
    """The preflight error for a Megatron dir given to `flag` (--ref-load, --load, ...) where
    the run reads Hugging Face dirs (or, under --train-backend megatron, a flag that does)."""
    origin = hf_checkpoint or "HF_MODEL_DIR"
    if "torch_dist" in found:
        fix = (
            f"convert it with `millstream convert torch-dist-to-hf --input-dir "
            f"{checkpoint_dir(path)} --output-dir HF_DIR --origin-hf-dir {origin}`"
        )
    else:
        fix = (
            "millstream reads Megatron's torch_dist format only: save it as torch_dist with "
            "Megatron-LM (--ckpt-format torch_dist), convert that to HF_DIR with `millstream "
            "convert torch-dist-to-hf`"
        )
    megatron = (
        "; or train with --train-backend megatron, which reads torch_dist checkpoints as "
        "--load and --ref-load"
        if "torch_dist" in found and flag in ("--load", "--ref-load")
        else ""
    )
    if flag == "--load":
        return (
            f"--load {path} is {found}; the torch backend resumes only its own checkpoints "
            f"(iter_N/ with model/ in Hugging Face format and {OUR_STATE}): {fix} and "
            f"start from it with --hf-checkpoint HF_DIR and a new --load dir{megatron}"
        )
    if flag == "--ref-load":
        instead = (
            "or drop --ref-load: the reference is then --hf-checkpoint"
            if hf_checkpoint
            else "or as --hf-checkpoint, the actor and the engines' model"
        )
        return (
            f"--ref-load {path} is {found}; the torch backend reads the reference model from "
            f"a Hugging Face model dir (config.json and safetensors): {fix} and pass "
            f"--ref-load HF_DIR ({instead}){megatron}"
        )
    return (
        f"{flag} {path} is {found}; {flag} takes a Hugging Face model dir (config.json and "
        f"safetensors): {fix} and pass {flag} HF_DIR"
    )
