"""Write an FP8 copy of a Hugging Face model dir (default: the shipped arith model), in the
block-wise layout of Qwen3-*-FP8 checkpoints, for FP8 rollout (docs/fp8.md).

    .venv/bin/python examples/arith/make_fp8.py OUT_DIR [--model-dir DIR]

1. Each decoder Linear weight (`model.layers.N.self_attn.{q,k,v,o}_proj.weight`,
   `model.layers.N.mlp.{gate,up,down}_proj.weight`) becomes float8_e4m3fn beside its
   `weight_scale_inv` (fp32, one scale per 128x128 block; the arith model's dims, 32 to 256,
   give partial blocks), quantized by the engine's own cast (millstream.engine.quant.fp8.quantize),
   so a weight update of the same weights lands bit for bit on this checkpoint.
2. Everything else (embeddings, norms, biases, a tied or untied lm_head) is copied as it is.
3. config.json gains the quantization_config; the tokenizer and the other files are copied.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
INDEX = "model.safetensors.index.json"


def make_fp8(model_dir: Path, out_dir: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from millstream.engine.quant.fp8 import SCALE_SUFFIX, quantize

    config = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise SystemExit(f"{model_dir} is quantized already: {config['quantization_config']}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != INDEX:
            shutil.copy2(item, out_dir / item.name)
    config["quantization_config"] = QUANTIZATION_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weight_map: dict[str, str] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(file).items():
            if LINEAR.search(name) and tensor.dim() == 2:
                q, scale_inv = quantize(tensor)
                tensors[name], tensors[name + SCALE_SUFFIX] = q, scale_inv
            else:
                tensors[name] = tensor
        save_file(tensors, out_dir / file.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
    if (model_dir / INDEX).is_file():
        index = json.loads((model_dir / INDEX).read_text())
        index["weight_map"] = weight_map
        (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--model-dir", type=Path, default=HERE / "model")
    args = parser.parse_args(argv)
    out = make_fp8(args.model_dir, args.out_dir)
    print(f"FP8 copy of {args.model_dir} in {out}")


if __name__ == "__main__":
    main()
