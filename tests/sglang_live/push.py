"""One weight sync by the trainer's own code (trainer/weights/sync.py WeightSync), from a
process of its own, as a trainer makes it: the arith model's weights moved by a seeded
perturbation, pushed as version V to the engines the router lists, by one route.

    python -m tests.sglang_live.push --router URL --engine URL --transport nccl|tensor|disk
        --version V --seed S --save DIR [--disk-dir DIR] [--pause-mode MODE] [--wait-for F]

It saves the pushed weights (DIR/model.safetensors, with the model's config and tokenizer:
a model transformers loads) and prints the sync's report as one JSON line. The engine's
placement is given as the launcher gives an SGLang server's (this machine's CPU): with it,
`--update-weight-transport tensor` takes SGLang's format over shared memory, which needs sglang
importable here, as in a trainer beside SGLang (the live tier runs this module with the
contract tier's SGLang package on its path for that route only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.sglang_live.server import ARITH_MODEL

SCALE = 0.05  # of each weight's own spread: enough to move every greedy log-prob


def perturbed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = load_file(ARITH_MODEL / "model.safetensors")
    return {
        n: (t + SCALE * t.std() * torch.randn(t.shape, generator=g)).contiguous()
        for n, t in base.items()
    }


def save_model(weights: dict[str, torch.Tensor], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in ARITH_MODEL.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(weights, out / "model.safetensors")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--router", required=True)
    p.add_argument("--engine", required=True)
    p.add_argument("--transport", required=True)
    p.add_argument("--version", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--save", type=Path, required=True)
    p.add_argument("--disk-dir", type=Path)
    p.add_argument("--pause-mode", default="abort")
    p.add_argument("--wait-for", type=Path, help="sync once this file exists (all set up)")
    args = p.parse_args(argv)
    if args.transport == "tensor":  # SGLang's package, as the contract tier loads it
        from tests.support import sglang_contract

        sglang_contract.stand_in_torchvision()
    from millstream.common import tensor_share
    from millstream.trainer.weights.sync import WeightSync

    weights = perturbed(args.seed)
    save_model(weights, args.save)
    ws = WeightSync(
        args.router,
        transport=args.transport,
        pause_mode=args.pause_mode,
        timeout_s=60,
        disk_dir=args.disk_dir,
        placements={args.engine: tensor_share.placement("cpu")},
        group_name=f"live_{args.transport}",
    )

    async def push() -> dict:
        while args.wait_for is not None and not args.wait_for.exists():
            await asyncio.sleep(0.01)
        try:
            report = await ws.sync(list(weights.items()), args.version)
        finally:
            await ws.close()
        return asdict(report)

    print(json.dumps(asyncio.run(push()), default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
