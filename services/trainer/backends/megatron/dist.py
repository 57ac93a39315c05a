"""Megatron's `torch_dist` checkpoints for the Megatron backend (issue 15): what Miles' Megatron
saves and loads (`--save`, `--load`, `--ref-load`) and what `millstream convert` writes.

A torch_dist checkpoint is one dir of torch.distributed.checkpoint files (`.metadata`,
`__0_0.distcp`, ...) with megatron's `metadata.json` and `common.pt`, written and read by
megatron-core's own `dist_checkpointing` from the GPTModel's sharded state dict. Its keys are
megatron's, not the module's: the layers stacked under one key each
(`decoder.layers.mlp.linear_fc1.weight`, [num_layers, ...]) and the layer norms under
Transformer Engine's names (`decoder.layers.self_attention.linear_qkv.layer_norm_weight`),
so a Miles (TE spec) checkpoint and ours name the same tensors alike. Each tensor parallel
rank writes its slice and one data parallel replica writes it; every rank of the default
process group takes part in a save and in a load.

It does not depend on the parallel layout: a load reshards, so a checkpoint saved with TP=2
loads with TP=1 and back. The one tensor whose shape depends on it is the vocabulary
(megatron_model.padded_vocab: a multiple of TP here, Megatron-LM pads to 128 x TP): a
checkpoint whose embedding or output layer has another number of rows is read whole, cut to
the model's vocabulary and padded again (`_load_repadded`).

In a run's checkpoints (trainer/checkpoints/checkpoint.py) the torch_dist files sit directly in `iter_N/`, beside
our `trainer_state.json`, the Hugging Face `model/` and the optimizer slices, so Megatron-LM
reads `iter_N/` as its own; `millstream convert` writes `ROOT/release/` with
`latest_checkpointed_iteration.txt` saying "release", as Miles' converter does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from millstream.common.errors import MillstreamError

from . import model as megatron_model

METADATA = "metadata.json"  # megatron's: {"sharded_backend": "torch_dist", ...}
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_torch_dist(directory: str | Path) -> bool:
    """True when `directory` holds a torch_dist checkpoint's files (not a root above one)."""
    path = Path(directory) / METADATA
    try:
        return json.loads(path.read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError, AttributeError):
        return False


def save(model: torch.nn.Module, directory: str | Path) -> None:
    """Write `model` (a GPTModel built by megatron_model.build) to `directory` as torch_dist.
    A collective: every rank of the default process group calls it with the same dir."""
    from megatron.core import dist_checkpointing

    try:  # megatron's writer imports it in its own process, where a failure hangs the save
        import psutil  # noqa: F401
    except ImportError:
        raise MillstreamError(
            "saving a torch_dist checkpoint needs psutil (megatron's writer uses it): "
            "pip install -e '.[megatron]'"
        ) from None
    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(directory))


def load(model: torch.nn.Module, directory: str | Path, hf: Any) -> None:
    """Read a torch_dist checkpoint into `model` (each rank its own slices; `hf`: the model's
    Hugging Face config). A collective, like `save`. A checkpoint of another model (other
    shapes, tensors missing) is an error naming the first differences."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    directory = str(directory)
    if not is_torch_dist(directory):
        raise MillstreamError(f"{directory} is not a torch_dist checkpoint (no {METADATA})")
    stored = FileSystemReader(directory).read_metadata().state_dict_metadata
    wanted = model.sharded_state_dict()
    differ = []
    for name, tensor in list(wanted.items()):
        if not isinstance(tensor, ShardedTensor):  # _extra_state: megatron's ShardedObject
            continue
        have = stored.get(tensor.key)
        if have is None:
            differ.append(f"{tensor.key} missing")
        elif tuple(have.size) != tuple(tensor.global_shape):
            if name in _VOCAB_ROWS and tuple(have.size)[1:] == tuple(tensor.global_shape)[1:]:
                continue  # another vocabulary padding: _load_repadded
            differ.append(
                f"{tensor.key} {tuple(have.size)}, the model's {tuple(tensor.global_shape)}"
            )
    if differ:
        raise MillstreamError(
            f"the torch_dist checkpoint {directory} is not this model's ({len(differ)} tensors "
            f"differ: {'; '.join(differ[:4])}): give the --hf-checkpoint it was made from"
        )
    repadded = {
        name: wanted.pop(name)
        for name in _VOCAB_ROWS
        if name in wanted
        and tuple(stored[wanted[name].key].size) != tuple(wanted[name].global_shape)
    }
    state = dist_checkpointing.load(wanted, directory)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for name, tensor in repadded.items():
        state[name] = _load_repadded(
            directory, tensor.key, stored[tensor.key].size, hf, tp_size, tp_rank
        )
    megatron_model.load_into(model, state, f"the torch_dist checkpoint {directory}")


def _load_repadded(
    directory: str, key: str, size: torch.Size, hf: Any, tp_size: int, tp_rank: int
) -> torch.Tensor:
    """The vocabulary rows stored under `key` with another padding: read whole, cut to the
    model's vocabulary, padded to this model's and sliced for this tensor parallel rank."""
    import torch.distributed.checkpoint as dcp

    whole = torch.empty(tuple(size))
    dcp.load({key: whole}, checkpoint_id=directory)
    rows = megatron_model.padded_vocab(hf, tp_size)
    value = whole[: hf.vocab_size]
    value = torch.cat([value, value.new_zeros(rows - len(value), *value.shape[1:])])
    return value.chunk(tp_size)[tp_rank].contiguous()
