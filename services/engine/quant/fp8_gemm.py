"""The W8A8 GEMMs of an FP8 Linear (fp8.py): what SGLang's block FP8 GEMM computes. Activations
are quantized per token per 128-column group (dynamic: each group's absmax / 448, SGLang's
per_token_group_quant_fp8); for each 128-column block k of the input dimension the fp8 products
are summed in fp32, times the token's group scale and the weight block's scale, and the blocks
summed in fp32 (DeepGEMM's promotion). Two ways to run it, the Linear's `gemm`:

  scaled_mm            one GEMM per Linear: `torch.nn.functional.scaled_mm` with the recipes
                       BlockWise1x128 (activations) x BlockWise128x128 (weights), cuBLASLt's
                       block-scaled FP8 GEMM (the DeepSeek-V3 recipe). torch 2.13 runs it on
                       compute capability 9.x only, with cuBLASLt >= 12.9
                       (aten/src/ATen/native/cuda/ScaledBlas.cpp `_check_deepseek_support`),
                       and the CPU not at all. Here both K and N are whole 128-blocks. Operands,
                       as torch's checks want them (torch/_meta_registrations.py
                       `_check_scaled_mm_sizes_v2`, as ScaledBlas.cpp
                       `_scaled_block1x128_block128x128`), with M' = M rounded up to 4:
                         mat_a    float8 [M', K] row-major, the activations (rows past M zero)
                         scale_a  fp32 [M', K/128], strides (1, M'): outer-dim-major
                         mat_b    float8 [K, N] column-major: the stored [N, K] weight, `.t()`
                         scale_b  fp32 [L4, N/128], strides (1, L4), L4 = K/128 rounded up to 4:
                                  weight_scale_inv [N/128, K/128] zero-padded to L4 columns, `.t()`
                       Rounding M up to 4 gives scale_a 16-byte strides, as L4 does for scale_b;
                       torch does not check it (its own tests use M a multiple of 128).
  scaled_mm_per_block  the same arithmetic as K/128 unit-scaled `torch._scaled_mm` calls, one
                       per 128-column block (any K and N that are multiples of 16), the scales
                       applied after each. Where the one call is not there: a GPU of compute
                       capability 8.9 or 10+, a cuBLASLt before 12.9, a dimension in a partial
                       block, and the CPU (torch 2.13 runs unit-scaled fp8 `_scaled_mm` there, so
                       `make test` checks this arithmetic end to end).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
# A block of zeros gets this absmax: its values quantize to 0 whatever the scale.
TINY_ABSMAX = 1e-12
BLOCK = (128, 128)  # the one weight_block_size served
# A Linear's forward (Fp8Linear.gemm): the one-call GEMM, the loop of K/128 GEMMs, and W8A16.
LAYER_GEMMS = ("scaled_mm", "scaled_mm_per_block", "dequant")
BLOCKWISE_MAJOR = 9  # torch: "DeepSeek style (1x128, 128x128) scaling only supported ... for SM90"
_blockwise_on: dict[str, bool] = {}  # CUDA device -> whether the one call ran there
# What a torch other than 2.13 raises at a scaled-GEMM call whose shape it does not know: no
# `F.scaled_mm` or recipe of that name (AttributeError; torch before 2.10 spelled the recipes
# `Blockwise_1x128`), another signature (TypeError), a kernel it was not built with
# (NotImplementedError, itself a RuntimeError), its checks (RuntimeError, ValueError). Each
# means "not this way here": the engine falls back to the next forward, never stops on it.
REFUSALS = (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError)


def quantize_activations(x_MK: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group quantization: (float8 [M, ceil(K/g)*g], fp32 scales [M, K/g])
    with each group of `group` columns of a row scaled by its absmax / 448 (padding is zero)."""
    m, k = x_MK.shape
    n_groups = math.ceil(k / group)
    x_MGg = F.pad(x_MK.float(), (0, n_groups * group - k)).view(m, n_groups, group)
    scale_MG = x_MGg.abs().amax(dim=-1).clamp(min=TINY_ABSMAX) / FP8_MAX
    x_q = (x_MGg / scale_MG[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_q.view(m, n_groups * group), scale_MG


def layer_gemm(gemm: str, out_features: int, in_features: int, blockwise: bool) -> str:
    """A Linear's forward under --fp8-gemm `gemm` (resolved), `blockwise` where the device runs
    the one call: that call where K and N are whole 128-blocks, else the loop where both are
    multiples of 16 (what `_scaled_mm` on CUDA takes), else dequant."""
    if gemm != "scaled_mm":
        return "dequant"
    if blockwise and in_features % BLOCK[1] == 0 and out_features % BLOCK[0] == 0:
        return "scaled_mm"
    if in_features % 16 == 0 and out_features % 16 == 0:
        return "scaled_mm_per_block"
    return "dequant"


def blockwise_operands(
    x_MK: torch.Tensor, q_NK: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mat_a, scale_a, mat_b, scale_b) of the one-call GEMM, in the layouts of the module
    docstring; its first x_MK.shape[0] rows are the Linear's."""
    m = x_MK.shape[0]
    x_MK = F.pad(x_MK, (0, 0, 0, -m % 4)) if m % 4 else x_MK
    x_q, scale_MG = quantize_activations(x_MK, block[1])
    scale_a = scale_MG.t().contiguous().t()  # [M', K/128], strides (1, M')
    k_blocks = scale_inv.shape[1]
    scale_NL = scale_inv.float()
    if k_blocks % 4:
        scale_NL = F.pad(scale_NL, (0, -k_blocks % 4))
    return x_q, scale_a, q_NK.t(), scale_NL.t()  # scale_b: [L4, N/128], strides (1, L4)


def blockwise_recipes() -> tuple[Any, Any]:
    """torch's (1x128, 128x128) block recipes, by either spelling (2.13: `BlockWise1x128`;
    the first `F.scaled_mm`: `Blockwise_1x128`); AttributeError where torch has neither."""
    kinds = F.ScalingType
    for a, b in (("BlockWise1x128", "BlockWise128x128"), ("Blockwise_1x128", "Blockwise_128x128")):
        if hasattr(kinds, a) and hasattr(kinds, b):
            return getattr(kinds, a), getattr(kinds, b)
    raise AttributeError(
        f"torch {torch.__version__}: torch.nn.functional.ScalingType has no 1x128 and 128x128 "
        f"block recipes ({', '.join(kinds.__members__)})"
    )


def scaled_mm_linear(
    x: torch.Tensor,
    q_NK: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] = BLOCK,
) -> torch.Tensor:
    """The W8A8 forward in one GEMM (module docstring), in the activations' dtype. With a bias,
    the GEMM's output is fp32 and the bias is added to it before the one rounding to that dtype
    (torch refuses a bias with an fp32 output; added to a bf16 output it would round twice)."""
    n, k = q_NK.shape
    x_MK = x.reshape(-1, k)
    mat_a, scale_a, mat_b, scale_b = blockwise_operands(x_MK, q_NK, scale_inv, block)
    recipe_a, recipe_b = blockwise_recipes()
    out_MN = F.scaled_mm(
        mat_a,
        mat_b,
        scale_a,
        recipe_a,
        scale_b,
        recipe_b,
        output_dtype=x.dtype if bias is None else torch.float32,
    )[: x_MK.shape[0]]
    if bias is not None:
        out_MN = (out_MN + bias.float()).to(x.dtype)
    return out_MN.view(*x.shape[:-1], n)


def per_block_linear(
    x: torch.Tensor,
    q_NK: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] = BLOCK,
) -> torch.Tensor:
    """The W8A8 forward as one unit-scaled `torch._scaled_mm` per 128-column block of the
    input, scales applied and summed in fp32."""
    n, k = q_NK.shape
    x_MK = x.reshape(-1, k)
    x_q, scale_MG = quantize_activations(x_MK, block[1])
    # Output column n of weight block j is scaled by scale_inv[n // bo, j].
    scale_GN = scale_inv.float().repeat_interleave(block[0], dim=0)[:n].t()
    one = torch.ones((), dtype=torch.float32, device=x.device)
    out_MN = torch.zeros(x_MK.shape[0], n, dtype=torch.float32, device=x.device)
    for j, start in enumerate(range(0, k, block[1])):
        end = min(start + block[1], k)
        partial_MN = torch._scaled_mm(
            x_q[:, start:end], q_NK[:, start:end].t(), one, one, out_dtype=torch.float32
        )
        out_MN += partial_MN * scale_MG[:, j : j + 1] * scale_GN[j]
    if bias is not None:
        out_MN += bias.float()
    return out_MN.to(x.dtype).view(*x.shape[:-1], n)


def blockwise_capable(capability: tuple[int, int] | None) -> bool:
    """Whether torch has the one-call GEMM for a device of this compute capability (None: the
    CPU): 9.x only; 8.9 and 10+ have only the loop (or row-wise scaling)."""
    return capability is not None and capability[0] == BLOCKWISE_MAJOR


def blockwise_supported(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether the Linears on `device` get the one call: its compute capability (`capability`
    stands for the device's where given), and on a CUDA device one small call that runs
    (torch also wants cuBLASLt >= 12.9, which only a call shows)."""
    if capability is None:
        if device.type != "cuda":
            return False
        capability = torch.cuda.get_device_capability(device)
    if not blockwise_capable(capability):
        return False
    return device.type != "cuda" or _blockwise_runs(device)


def _blockwise_runs(device: torch.device) -> bool:
    key = str(device)
    if key not in _blockwise_on:
        q, scale_inv = torch.zeros(128, 128, device=device).to(FP8_DTYPE), torch.ones(1, 1)
        try:
            x = torch.ones(1, 128, dtype=torch.bfloat16, device=device)
            scaled_mm_linear(x, q, scale_inv.to(device), None)
            _blockwise_on[key] = True
        except REFUSALS as err:
            log.warning(
                "FP8: no one-call block-scaled GEMM on %s (%s: %s); K/128 GEMMs per Linear",
                device,
                type(err).__name__,
                err,
            )
            _blockwise_on[key] = False
    return _blockwise_on[key]
