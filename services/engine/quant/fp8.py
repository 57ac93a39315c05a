"""FP8 rollout: a block-wise FP8 checkpoint served in FP8, and full-precision weight updates
cast into it.

The checkpoint (the layout of Qwen3-*-FP8 and DeepSeek-V3, which transformers'
`integrations/finegrained_fp8.py` and SGLang read): config.json carries
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
and each quantized Linear stores `<module>.weight` as float8_e4m3fn [out, in] beside
`<module>.weight_scale_inv`, fp32 [ceil(out/128), ceil(in/128)]: block (i, j) of the weight is
`weight[i-block, j-block] * weight_scale_inv[i, j]`. A dimension that is not a multiple of 128
ends in a partial block. Embeddings, norms, lm_head and biases stay in full precision. Which
Linears are FP8 is the checkpoint's say: those with a `weight_scale_inv`.

Quantizing (a weight update, examples/arith/make_fp8.py): per block, with s = absmax / 448,
    q = round_e4m3(w / s)    (round to nearest even, saturating at +-448).
e4m3 keeps 3 mantissa bits, so a scaled value in e4m3's normal range (|w / s| >= 2^-6) is off
by at most half a step, 2^-4 of its size, and one below it by at most half the subnormal step
2^-9: |w - q * s| <= |w| / 16 + s / 1024 (tests/unit/engine/quant/test_fp8.py holds every element to it).

The forward (`Fp8Linear.gemm`, set from --fp8-gemm by `set_gemm`):
  dequant    W8A16: q * s expanded over the blocks, in fp32, cast to the activations' dtype,
             then an ordinary matmul. The CPU's, and a GPU's below compute capability 8.9.
  scaled_mm  W8A8, what SGLang's block FP8 GEMM computes (fp8_gemm.py): activations quantized
             per token per 128-column group, the fp8 products of each 128-column block of the
             input summed in fp32, times the token's group scale and the weight block's scale,
             summed in fp32. The default on a GPU of compute capability >= 8.9. Per Linear it is
             one GEMM, `torch.nn.functional.scaled_mm` with the BlockWise1x128 x
             BlockWise128x128 recipe (torch has it on compute capability 9.x only), where the
             device has it and K and N are whole 128-blocks; otherwise `scaled_mm_per_block`,
             the same arithmetic as one unit-scaled `torch._scaled_mm` per 128-column block
             (K/128 GEMMs), where both are multiples of 16; otherwise dequant. The CPU has the
             loop (torch 2.13 runs unit-scaled fp8 `_scaled_mm` there, so `make test` checks
             its numerics) but not the one call: `make test` checks that call's operands against
             torch's own checks and its arithmetic in an emulation (tests/unit/engine/quant/test_fp8.py).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from millstream.common.errors import MillstreamError

from . import fp8_gemm
from .fp8_gemm import BLOCK as BLOCK
from .fp8_gemm import FP8_DTYPE as FP8_DTYPE
from .fp8_gemm import FP8_MAX as FP8_MAX
from .fp8_gemm import quantize_activations as quantize_activations

log = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" + this
GEMMS = ("auto", "scaled_mm", "dequant")  # --fp8-gemm (engine/config.py repeats it, torch-free)
_TINY_ABSMAX = fp8_gemm.TINY_ABSMAX
_SCALED_MM_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later


def block_of(quantization_config: dict[str, Any] | None, model_path: str) -> tuple[int, int] | None:
    """The FP8 block of a checkpoint's quantization_config, None when it has none; a scheme
    this engine does not serve is an error naming the field."""
    if quantization_config is None:
        return None
    where = f"--model-path {model_path}: config.json quantization_config"
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise MillstreamError(
            f"{where} quant_method {method!r} is not served (this engine serves block-wise "
            "FP8 checkpoints: quant_method fp8)"
        )
    wanted = {"fmt": "e4m3", "activation_scheme": "dynamic"}
    for key, value in wanted.items():
        if quantization_config.get(key, value) != value:
            raise MillstreamError(
                f"{where} {key} {quantization_config[key]!r} is not served (only {value!r})"
            )
    if quantization_config.get("scale_fmt") not in (None, "float"):
        raise MillstreamError(
            f"{where} scale_fmt {quantization_config['scale_fmt']!r} is not served "
            "(only fp32 block scales)"
        )
    block = quantization_config.get("weight_block_size")
    if block is None or list(block) != list(BLOCK):
        raise MillstreamError(
            f"{where} weight_block_size {block!r} is not served: this engine serves 128x128 "
            "blocks (weight_block_size [128, 128], the Qwen3-FP8 and DeepSeek-V3 layout)"
        )
    return BLOCK


def read_block(model_path: str | Path) -> tuple[int, int] | None:
    """`block_of` the quantization_config in `model_path`/config.json."""
    config = json.loads(Path(model_path, "config.json").read_text())
    return block_of(config.get("quantization_config"), str(model_path))


def scale_shape(shape: torch.Size | tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def _blocks(w_OI: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[O, I] zero-padded to whole blocks, viewed as [O/bo, bo, I/bi, bi]."""
    (n_o, n_i), (bo, bi) = scale_shape(w_OI.shape, block), block
    out, inp = w_OI.shape
    padded = F.pad(w_OI, (0, n_i * bi - inp, 0, n_o * bo - out))
    return padded.view(n_o, bo, n_i, bi)


def quantize(
    w_OI: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [O, I], fp32 scale_inv [ceil(O/bo), ceil(I/bi)]): the module docstring."""
    blocks = _blocks(w_OI.detach().float(), block)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=_TINY_ABSMAX) / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    out, inp = w_OI.shape
    return q.view(blocks.shape[0] * block[0], -1)[:out, :inp].contiguous(), scale_inv


def expand_scales(
    scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]
) -> torch.Tensor:
    """The block scales repeated over their blocks, cut to `shape`."""
    rows = scale_inv.repeat_interleave(block[0], dim=0)[: shape[0]]
    return rows.repeat_interleave(block[1], dim=1)[:, : shape[1]]


def dequantize(
    q_OI: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q * its block's scale, in fp32 (exact: an e4m3 value times an fp32 scale), then `dtype`."""
    scales_OI = expand_scales(scale_inv.float(), tuple(q_OI.shape), block)  # type: ignore[arg-type]
    return (q_OI.float() * scales_OI).to(dtype)


class Fp8Linear(torch.nn.Module):
    """A Linear whose weight is block-wise FP8: `weight` float8_e4m3fn [out, in] and
    `weight_scale_inv` fp32, under the checkpoint's names (so a weight update names them as
    the Hugging Face model does); the bias stays in the model's dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale_inv: torch.Tensor,
        bias: torch.Tensor | None,
        block: tuple[int, int] = BLOCK,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = block
        self.gemm = "dequant"
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(weight_scale_inv, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"block={list(self.block)}, gemm={self.gemm}, bias={self.bias is not None}"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm == "dequant":
            w = dequantize(self.weight, self.weight_scale_inv, self.block, x.dtype)
            return F.linear(x, w, self.bias)
        if self.gemm == "scaled_mm":  # one GEMM
            w8a8 = fp8_gemm.scaled_mm_linear
        elif self.gemm == "scaled_mm_per_block":  # K/128 GEMMs
            w8a8 = fp8_gemm.per_block_linear
        else:
            raise ValueError(f"Fp8Linear.gemm {self.gemm!r}: not one of {fp8_gemm.LAYER_GEMMS}")
        return w8a8(x, self.weight, self.weight_scale_inv, self.bias, self.block)

    @torch.no_grad()
    def load_full(self, w_OI: torch.Tensor) -> None:
        """A full-precision weight (what millstream's trainer sends), cast to this layer's
        FP8 scheme."""
        q, scale_inv = quantize(w_OI.to(self.weight.device), self.block)
        self.weight.copy_(q)
        self.weight_scale_inv.copy_(scale_inv)

    @torch.no_grad()
    def load_quantized(self, q_OI: torch.Tensor, scale_inv: torch.Tensor) -> None:
        """An update already in FP8 (Miles' megatron sender quantizes before it sends)."""
        self.weight.copy_(q_OI)
        self.weight_scale_inv.copy_(scale_inv)


def fp8_layers(model: torch.nn.Module) -> dict[str, Fp8Linear]:
    """`<module>.weight` -> its Fp8Linear."""
    return {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def is_scale_of(name: str, layers: dict[str, Fp8Linear]) -> bool:
    return name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in layers


def update_refusal(
    layers: dict[str, Fp8Linear], tensors: list[tuple[str, torch.Tensor]]
) -> str | None:
    """Why a weight update cannot go into these FP8 layers (None: it can). An FP8 tensor is an
    FP8 layer's weight, with its weight_scale_inv in the same update; a weight_scale_inv comes
    with its FP8 weight (a full-precision weight gets its scales here)."""
    given = dict(tensors)
    for name, tensor in tensors:
        if tensor.dtype == FP8_DTYPE:
            if name not in layers:
                return f"{name}: float8_e4m3fn, but that parameter is not FP8 in this model"
            if name + SCALE_SUFFIX not in given:
                return f"{name}: FP8 without its {name + SCALE_SUFFIX} in the same update"
        elif is_scale_of(name, layers):
            weight = given.get(name.removesuffix(SCALE_SUFFIX))
            if weight is None or weight.dtype != FP8_DTYPE:
                return (
                    f"{name}: block scales come with their float8_e4m3fn weight in the same "
                    "update (a full-precision weight is cast to FP8 here, scales and all)"
                )
    return None


def _read_checkpoint(model_path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise MillstreamError(f"--model-path {model_path}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def _split_fp8(
    state: dict[str, torch.Tensor], block: tuple[int, int], dtype: torch.dtype, where: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Take each FP8 weight and its scales out of `state` (module name -> (q, scale_inv)),
    leaving their dequantized weight in its place; a pair that does not fit is an error."""
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for scale_name in [n for n in state if n.endswith(".weight" + SCALE_SUFFIX)]:
        name = scale_name.removesuffix(SCALE_SUFFIX)
        q, scale_inv = state.get(name), state.pop(scale_name)
        if q is None or q.dtype != FP8_DTYPE or q.dim() != 2:
            found = "missing" if q is None else f"{q.dtype} {list(q.shape)}"
            raise MillstreamError(f"{where}: {name} should be a float8_e4m3fn matrix ({found})")
        if tuple(scale_inv.shape) != scale_shape(q.shape, block):
            raise MillstreamError(
                f"{where}: {scale_name} is {list(scale_inv.shape)}, not "
                f"{list(scale_shape(q.shape, block))} for {name} {list(q.shape)} in "
                f"{block[0]}x{block[1]} blocks"
            )
        pairs[name.removesuffix(".weight")] = (q, scale_inv.float())
        state[name] = dequantize(q, scale_inv, block, dtype)
    stray = [n for n, t in state.items() if t.dtype == FP8_DTYPE]
    if stray:
        raise MillstreamError(f"{where}: FP8 tensors without a weight_scale_inv: {stray[:5]}")
    if not pairs:
        raise MillstreamError(f"{where}: quantization_config says fp8 but no weight_scale_inv")
    return pairs


def load_model(model_path: str, dtype: torch.dtype, block: tuple[int, int]) -> torch.nn.Module:
    """The Hugging Face model of an FP8 checkpoint, its quantized Linears as Fp8Linear.

    transformers' own FP8 loader is not used: without a GPU it dequantizes the model to bf16
    (and it needs accelerate), on one it wants the finegrained-fp8 kernels package, and it
    derives a block from the scale grid (rows // scale rows), wrong where a dimension ends
    in a partial block. Here the model is built from the checkpoint dequantized (so the
    skeleton loads with nothing missing or unexpected), then each FP8 Linear is swapped for
    an Fp8Linear holding the stored e4m3 weight and scales."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, GenerationConfig

    path = Path(model_path)
    where = f"--model-path {model_path}"
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    del config.quantization_config  # built plain; the FP8 layers come after
    state = _read_checkpoint(path)
    pairs = _split_fp8(state, block, dtype, where)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    if Path(path, "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    del state
    for module_name, (q, scale_inv) in pairs.items():
        linear = model.get_submodule(module_name)
        if type(linear) is not torch.nn.Linear:
            raise MillstreamError(
                f"{where}: {module_name} has FP8 weights but is a {type(linear).__name__}, "
                "not a Linear (only dense Linears are served in FP8)"
            )
        bias = None if linear.bias is None else linear.bias.data
        model.set_submodule(module_name, Fp8Linear(q, scale_inv, bias, block))
    return model


def choose_gemm(gemm: str, device: torch.device, capability: tuple[int, int] | None = None) -> str:
    """--fp8-gemm auto: scaled_mm on a GPU with FP8 tensor cores, else dequant. `capability`
    stands for the device's compute capability where given (None: read from a CUDA device)."""
    if gemm != "auto":
        return gemm
    if capability is None and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
    if capability is not None and capability >= _SCALED_MM_CAPABILITY:
        return "scaled_mm"
    return "dequant"


def set_gemm(
    model: torch.nn.Module, gemm: str, capability: tuple[int, int] | None = None
) -> dict[str, int]:
    """Every Fp8Linear's forward under --fp8-gemm `gemm` (resolved): with scaled_mm, the one
    block-scaled GEMM where the device has it (`fp8_gemm.blockwise_supported`; `capability`
    stands for the device's where given) and the layer is whole 128-blocks, else the per-block
    loop where its dimensions are multiples of 16, else dequant. Returns the count of each."""
    layers = list(fp8_layers(model).values())
    counts = dict.fromkeys(fp8_gemm.LAYER_GEMMS, 0)
    if not layers:
        return counts
    device = layers[0].weight.device
    blockwise = gemm == "scaled_mm" and fp8_gemm.blockwise_supported(device, capability)
    for layer in layers:
        layer.gemm = fp8_gemm.layer_gemm(gemm, layer.out_features, layer.in_features, blockwise)
        counts[layer.gemm] += 1
    return counts


@torch.inference_mode()
def probe_scaled_mm(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype
) -> dict[str, int]:
    """The first layer of each W8A8 forward in use (the one call, the loop) against the same
    arithmetic in plain fp32 matmuls, once at start-up. A forward that this torch refuses (its
    `fp8_gemm.REFUSALS`: another version's signature or recipe names, a kernel it lacks) falls
    back, with a warning naming the error: the one call to the loop, the loop to dequant. A
    GPU that computes it otherwise stops the engine here, naming it, rather than serving wrong
    log-probs (--fp8-gemm dequant is the way round). Returns the count of each forward."""
    layers = list(fp8_layers(model).values())
    fallback = {"scaled_mm": "scaled_mm_per_block", "scaled_mm_per_block": "dequant"}
    for gemm in ("scaled_mm", "scaled_mm_per_block"):
        using = [m for m in layers if m.gemm == gemm]
        if using and (refusal := _probe(using[0], device, dtype)) is not None:
            log.warning(
                "FP8: %s refused on %s (%s); its %d Linears compute by %s",
                _HOW[gemm],
                device,
                refusal,
                len(using),
                fallback[gemm],
            )
            for layer in using:
                layer.gemm = fallback[gemm]
    counts = dict.fromkeys(fp8_gemm.LAYER_GEMMS, 0)
    for layer in layers:
        counts[layer.gemm] += 1
    return counts


_HOW = {"scaled_mm": "one block-scaled scaled_mm", "scaled_mm_per_block": "_scaled_mm per block"}


def _probe(layer: Fp8Linear, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when `layer`'s forward computes the W8A8 arithmetic; the refusal, as text, when
    torch refused to run it. A forward that runs and computes otherwise is an error."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, layer.in_features, generator=gen).to(device, dtype)
    x_q, scale_MG = quantize_activations(x, layer.block[1])
    k = layer.in_features
    x_deq = (x_q.float().view(5, -1, layer.block[1]) * scale_MG[:, :, None]).view(5, -1)[:, :k]
    w = dequantize(layer.weight, layer.weight_scale_inv, layer.block)
    want = x_deq @ w.t() + (0 if layer.bias is None else layer.bias.float())
    try:
        got = layer(x).float()
    except fp8_gemm.REFUSALS as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
    if not error < 2e-2:  # bf16 output rounding is up to 2^-8; NaN fails too
        raise MillstreamError(
            f"--fp8-gemm scaled_mm ({_HOW[layer.gemm]}): on {device} it is {error:.3g} "
            "(relative) off the same arithmetic in fp32; run with --fp8-gemm dequant"
        )
    return None
