"""FP8 weights for an SGLang server that serves a block-wise FP8 checkpoint: the trainer
quantizes before it sends, as Miles does.

Why: SGLang builds each quantized Linear of an FP8-serialized checkpoint (config.json
`quantization_config.quant_method: "fp8"`) with a float8_e4m3fn `weight` and an fp32
`weight_scale_inv`, and its weight loader copies what it is sent into them as they are. A
full-precision weight sent there is cast to e4m3 without its scales: wrong weights, no error.
(millstream's own engine quantizes full-precision updates on load, engine/quant/fp8.py; it also takes
FP8 weights with their scales, so an update group shared with it may carry these.)

What the engine serves, read from its checkpoint (`read_layout`, from the engine's model_path in
its /get_server_info, on this machine or a file system both see):
    block      quantization_config.weight_block_size ([128, 128] in Qwen3-*-FP8, DeepSeek-V3)
    quantized  the "<module>.weight" names stored beside a "<module>.weight_scale_inv"
and refused by name: another quant_method, fmt other than e4m3, static activations, ue8m0
scales (DeepGEMM's power-of-two scales: a format this trainer does not write), no block.

The cast (`quantize`), per block of the weight (a partial block at the end of a dimension
counts its real elements; its padding is zeros), in fp32:
    s = max(absmax(block), 1e-4) / 448        weight_scale_inv, fp32 [ceil(O/bo), ceil(I/bi)]
    q = e4m3(w / s)                           round to nearest even; |w / s| <= 448
SGLang's own DeepSeek-V3 block-FP8 cast (`bf16_to_block_fp8_128`,
layers/quantization/mxfp8_block_convert.py) computes the same, op for op; the contract test
(tests/contract/test_fp8_quant.py) holds the two to the same bits on CPU tensors. The 1e-4 floor
is SGLang's: a block whose absmax is below it keeps s = 1e-4 / 448 (engine/quant/fp8.py floors at
1e-12 instead; the two agree everywhere else).

Where: `Fp8Buckets` quantizes one bucket when a route reads it (the routes read in a worker
thread; `buckets_for` hands them to the routes with an FP8 SGLang server on them), on the weights' device (the trainer's GPU), so a sync holds one quantized bucket at
a time, not a quantized model; a weight and its scales stay in one bucket.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import torch
import torch.nn.functional as F

from millstream.common.errors import MillstreamError

from .routes.base import Bucket, aligned

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # SGLang's floor on a block's absmax
SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" + this


@dataclass(frozen=True)
class Fp8Layout:
    """What an FP8 engine's checkpoint quantizes, and in which blocks."""

    block: tuple[int, int]
    quantized: frozenset[str]  # "<module>.weight" names stored in e4m3 with block scales
    source: str  # the checkpoint directory it was read from

    def __str__(self) -> str:
        n = len(self.quantized)
        return (
            f"FP8 checkpoint: the trainer casts {n} weight{'s' * (n != 1)} to e4m3 in "
            f"{self.block[0]}x{self.block[1]} blocks before sending"
        )


def quantize(
    w_OI: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [O, I], fp32 weight_scale_inv [ceil(O/bo), ceil(I/bi)]): the module
    docstring's cast."""
    if w_OI.dim() != 2:
        raise ValueError(f"FP8 block cast: a matrix, got shape {list(w_OI.shape)}")
    (out, inp), (bo, bi) = w_OI.shape, block
    n_o, n_i = math.ceil(out / bo), math.ceil(inp / bi)
    padded = F.pad(w_OI.detach().to(torch.float32), (0, n_i * bi - inp, 0, n_o * bo - out))
    blocks = padded.view(n_o, bo, n_i, bi)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (blocks / scale).to(FP8_DTYPE).view(n_o * bo, n_i * bi)
    return q[:out, :inp].contiguous(), scale.view(n_o, n_i)


def quantize_bucket(bucket: Bucket, layout: Fp8Layout) -> Bucket:
    """The bucket with each weight `layout` quantizes replaced by its e4m3 weight and, right
    after it, its weight_scale_inv; every other tensor as it was."""
    out = Bucket()
    for name, tensor in zip(bucket.names, bucket.tensors, strict=True):
        pieces = [(name, tensor)]
        if name in layout.quantized:
            q, scale_inv = quantize(tensor, layout.block)
            pieces = [(name, q), (name + SCALE_SUFFIX, scale_inv)]
        for piece_name, piece in pieces:
            out.names.append(piece_name)
            out.tensors.append(piece)
            out.nbytes += piece.numel() * piece.element_size()
    return aligned(out)


class Fp8Buckets(Sequence[Bucket]):
    """`buckets`, each quantized by `layout` when it is read (module docstring: where)."""

    def __init__(self, buckets: Sequence[Bucket], layout: Fp8Layout):
        self._buckets, self.layout = buckets, layout

    def __len__(self) -> int:
        return len(self._buckets)

    @overload
    def __getitem__(self, k: int) -> Bucket: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[Bucket]: ...
    def __getitem__(self, k: int | slice) -> Bucket | Sequence[Bucket]:
        if isinstance(k, slice):
            return Fp8Buckets(self._buckets[k], self.layout)
        return quantize_bucket(self._buckets[k], self.layout)

    def __iter__(self) -> Iterator[Bucket]:
        return (quantize_bucket(b, self.layout) for b in self._buckets)


def buckets_for(
    buckets: Sequence[Bucket], layouts: Mapping[str, Fp8Layout]
) -> Callable[[list[str]], Sequence[Bucket]]:
    """For a route's engines: the buckets they take, FP8 ones (`Fp8Buckets`) when an FP8
    SGLang server is among them. `layouts`: the FP8 layout of each engine of this sync that
    serves one (engines.py); one run serves one checkpoint, so more than one is an error."""
    distinct = set(layouts.values())
    if len(distinct) > 1:
        raise MillstreamError(
            "weight sync: the SGLang servers serve different FP8 checkpoints "
            f"({sorted(layout.source for layout in distinct)}); one run serves one"
        )
    quantized = Fp8Buckets(buckets, distinct.pop()) if distinct else None

    def take(urls: list[str]) -> Sequence[Bucket]:
        if quantized is not None and any(u in layouts for u in urls):
            return quantized
        return buckets

    return take


def layout_of(info: Mapping[str, Any]) -> Fp8Layout | None:
    """The FP8 layout an SGLang server serves, from its /get_server_info (None: it serves full
    precision; an FP8 checkpoint this trainer cannot write for, or cannot read, raises
    ValueError with why)."""
    model_path = info.get("model_path")
    config = Path(str(model_path), "config.json") if model_path else None
    if config is None or not config.is_file():
        if str(info.get("quantization") or "").startswith("fp8"):
            raise ValueError(
                f"it serves quantization {info.get('quantization')!r} from {model_path!r}, whose "
                "config.json is not readable here: the trainer cannot tell whether (and which) "
                "weights to cast to FP8 before sending (its checkpoint must be readable at the "
                "same path on the trainer's machine)"
            )
        return None
    return read_layout(str(model_path))


@functools.cache
def read_layout(model_path: str) -> Fp8Layout | None:
    """The FP8 layout of the checkpoint in `model_path` (None: not FP8-serialized); ValueError
    naming the field for a scheme this trainer does not write."""
    config = json.loads(Path(model_path, "config.json").read_text())
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        return None  # full precision (SGLang's online --quantization fp8 casts on load itself)
    where = f"{model_path}/config.json quantization_config"
    for key, wanted in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if qc.get(key, wanted) != wanted:
            raise ValueError(f"{where} {key} {qc[key]!r}: the trainer casts only to {wanted!r}")
    if qc.get("scale_fmt") not in (None, "float"):
        raise ValueError(
            f"{where} scale_fmt {qc['scale_fmt']!r}: the trainer writes fp32 block scales only"
        )
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise ValueError(
            f"{where} weight_block_size {block!r}: the trainer casts block-wise FP8 only "
            "(per-tensor and per-channel FP8 checkpoints are not written)"
        )
    names = _checkpoint_names(Path(model_path))
    quantized = frozenset(
        n.removesuffix(SCALE_SUFFIX) for n in names if n.endswith(".weight" + SCALE_SUFFIX)
    )
    if not quantized:
        raise ValueError(f"{where} says fp8 but no tensor has a weight{SCALE_SUFFIX}")
    return Fp8Layout((int(block[0]), int(block[1])), quantized, model_path)


def _checkpoint_names(path: Path) -> list[str]:
    """The tensor names of a safetensors checkpoint (its index, or each file's header)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return names
