"""The trainer side of a weight sync, as a separate process: rank 0 of an update group.

    python -m tests.support.weight_sender --model-path SRC --out-dir DST --master-port P \
        [--group-name G] [--world-size 2] [--seed 1] [--scale 0.05]

1. Perturbs every tensor of SRC's safetensors with seeded noise and writes a complete model
   directory DST (so a test can load the new weights into a fresh HF model), plus
   DST/manifest.json = {names, dtypes, shapes}, the body of /update_weights_from_distributed.
2. Hosts the rendezvous at 127.0.0.1:P and joins the group as rank 0 the way SGLang's (and
   Miles') `init_custom_process_group` does: TCPStore + PrefixStore(group_name) + torch's
   process-group helper. Written independently of the engine's code on purpose.
3. Broadcasts each tensor in manifest order with `torch.distributed.broadcast(src=0)`,
   prints `SENT <n>`, and exits once its stdin is closed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import torch


def perturbed_model_dir(src: Path, dst: Path, seed: int, scale: float) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file, save_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    generator = torch.Generator().manual_seed(seed)
    new = {
        name: tensors[name] + scale * torch.randn(tensors[name].shape, generator=generator)
        for name in sorted(tensors)
    }
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, dst / file.name)
    save_file(new, dst / "model.safetensors", metadata={"format": "pt"})
    manifest = {
        "names": list(new),
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in new.values()],
        "shapes": [list(t.shape) for t in new.values()],
    }
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return new


def join_group_as_rank0(port: int, world_size: int, group_name: str, timeout_s: float):
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend("gloo"),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--model-path", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--master-port", required=True, type=int)
    parser.add_argument("--group-name", default="weight_update_group")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    tensors = perturbed_model_dir(args.model_path, args.out_dir, args.seed, args.scale)
    print("READY", flush=True)
    pg = join_group_as_rank0(args.master_port, args.world_size, args.group_name, args.timeout)
    print("JOINED", flush=True)
    for tensor in tensors.values():
        torch.distributed.broadcast(tensor.contiguous(), src=0, group=pg)
    print(f"SENT {len(tensors)}", flush=True)
    # Stay in the group until the caller closes our stdin: leaving right after the last
    # send could cut the connection before the engine has read everything.
    sys.stdin.read()
    # Skip interpreter teardown: gloo's pairs can abort the process when torn down while
    # the peer still holds the group, which would make the exit code meaningless.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
