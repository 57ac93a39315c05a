"""The trainer's FP8 cast for an FP8 SGLang server, judged by SGLang's own code on CPU tensors.

  * the same bits as SGLang's block-FP8 cast (`bf16_to_block_fp8_128`, the DeepSeek-V3 block
    contract SGLang converts into): e4m3 weight and fp32 weight_scale_inv, for bf16 and fp32
    weights, whole and partial 128x128 blocks, zero, tiny and large blocks;
  * the shapes and dtypes of the parameters SGLang's `Fp8LinearMethod` registers for such a
    Linear from the checkpoint's quantization_config (what its weight loader copies into);
  * SGLang's own dequantization (`block_quant_dequant`) of what the trainer sends is within
    e4m3's rounding of the trainer's weight: |w - q*s| <= |w|/16 + s/1024.

Two broken casts show the first check can fail: the engine's floor (engine/quant/fp8.py: absmax
floored at 1e-12, not SGLang's 1e-4) on a tiny block, and a scale made by a multiplication by
1/448 instead of a division.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from millstream.trainer.weights.fp8_weights import AMAX_FLOOR, FP8_MAX, quantize

BLOCK = (128, 128)


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    partial = torch.randn(300, 200, generator=g)  # 3 x 2 blocks, the last ones partial
    partial[:128, :128] = 0.0  # a block of zeros
    partial[128:256, :128] *= 1e-7  # a block under SGLang's absmax floor
    partial[256:, 128:] *= 1e4  # a large one
    return {
        "bf16 256x384": torch.randn(256, 384, generator=g).to(torch.bfloat16),
        "fp32 300x200 (partial, zero, tiny, large blocks)": partial,
        "bf16 1x1": torch.tensor([[0.37]], dtype=torch.bfloat16),
        "fp32 129x1": torch.randn(129, 1, generator=g),
    }


def sglang_cast(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.srt.layers.quantization.mxfp8_block_convert import bf16_to_block_fp8_128

    return bf16_to_block_fp8_128(w, block=BLOCK[0])


def differences(cast) -> list[str]:
    """Where `cast` and SGLang's differ, bit for bit, one line per weight."""
    out = []
    for name, w in weights().items():
        q, s = cast(w)
        want_q, want_s = sglang_cast(w)
        if q.dtype != want_q.dtype or s.dtype != want_s.dtype or q.shape != want_q.shape:
            out.append(f"{name}: {q.dtype} {list(q.shape)} / {s.dtype}, SGLang's "
                       f"{want_q.dtype} {list(want_q.shape)} / {want_s.dtype}")  # fmt: skip
            continue
        q_bits, s_bits = q.view(torch.uint8), s.contiguous().view(torch.int32)
        bad_q = (q_bits != want_q.view(torch.uint8)).sum().item()
        bad_s = (s_bits != want_s.contiguous().view(torch.int32)).sum().item()
        if bad_q or bad_s:
            out.append(f"{name}: {bad_q} e4m3 value(s) and {bad_s} scale(s) differ from SGLang's")
    return out


def test_the_trainers_cast_is_sglangs_bit_for_bit():
    assert differences(quantize) == []


def test_a_cast_with_another_floor_or_rounding_is_caught():
    from millstream.engine.quant import fp8 as engine_fp8

    floor = differences(engine_fp8.quantize)
    assert floor == ["fp32 300x200 (partial, zero, tiny, large blocks): 16384 e4m3 value(s) and 2 "
                     "scale(s) differ from SGLang's"], floor  # fmt: skip

    def by_reciprocal(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (out, inp), b = w.shape, BLOCK[0]
        n_o, n_i = -(-out // b), -(-inp // b)
        padded = F.pad(w.float(), (0, n_i * b - inp, 0, n_o * b - out))
        blocks = padded.view(n_o, b, n_i, b)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
        scale = amax * (1.0 / FP8_MAX)  # not amax / 448: an ulp off in some blocks
        q = (blocks / scale).to(torch.float8_e4m3fn).view(n_o * b, n_i * b)
        return q[:out, :inp].contiguous(), scale.view(n_o, n_i)

    reciprocal = differences(by_reciprocal)
    assert reciprocal and all("scale(s) differ" in line for line in reciprocal), reciprocal
    print(f"engine floor: {floor}\nby reciprocal: {reciprocal}")


def test_sglangs_fp8_linear_takes_these_shapes_and_dtypes():
    """The parameters SGLang registers for a block-FP8 Linear of an FP8-serialized checkpoint
    (its weight loader copies what it is sent into them)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    config = Fp8Config.from_config(
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": list(BLOCK)}
    )  # fmt: skip
    assert config.is_checkpoint_fp8_serialized
    for name, w in weights().items():
        layer = torch.nn.Module()
        layer.tp_group = None  # one rank: SGLang's partition checks have nothing to split
        out, inp = w.shape
        Fp8LinearMethod.create_fp8_weight_(
            layer, block_quant=True, quant_config=config, use_mxfp8=False,
            output_size_per_partition=out, input_size_per_partition=inp,
            output_partition_sizes=[out], input_size=inp, output_size=out,
            params_dtype=torch.bfloat16, weight_loader=None, is_checkpoint_fp8_serialized=True,
        )  # fmt: skip
        q, s = quantize(w, BLOCK)
        assert (q.dtype, q.shape) == (layer.weight.dtype, layer.weight.shape), name
        assert (s.dtype, s.shape) == (layer.weight_scale_inv.dtype, layer.weight_scale_inv.shape)
        layer.weight.data.copy_(q)  # what its default loader does on one rank
        layer.weight_scale_inv.data.copy_(s)


def test_sglangs_dequantization_gives_back_the_weight_within_e4m3_rounding():
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant

    for name, w in weights().items():
        q, s = quantize(w, BLOCK)
        back = block_quant_dequant(q, s, list(BLOCK), torch.float32)
        w32 = w.float()
        scales = s.repeat_interleave(BLOCK[0], 0)[: w.shape[0]].repeat_interleave(BLOCK[1], 1)
        bound = w32.abs() / 16 + scales[:, : w.shape[1]] / 1024
        worst = ((back - w32).abs() - bound).max().item()
        assert worst <= 0, f"{name}: {worst} over e4m3's rounding"
    # The floor: a block under it is cast with s = 1e-4 / 448, and still comes back.
    floored = torch.tensor([[AMAX_FLOOR]]) / FP8_MAX  # in fp32, as the cast computes it
    assert torch.equal(quantize(torch.full((2, 2), 1e-9))[1], floored)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sglangs_deepgemm_cast_is_another_format(dtype):
    """SGLang's `per_block_cast_to_fp8` (DeepGEMM's) rounds each scale up to a power of two
    (ue8m0, `scale_fmt: "ue8m0"` checkpoints): not this format, and refused by the trainer
    (fp8_weights.read_layout) rather than sent as if it were."""
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    w = weights()["bf16 256x384"].to(dtype)
    _, s_ue8m0 = per_block_cast_to_fp8(w)
    mantissa = s_ue8m0.view(torch.int32) & 0x7FFFFF
    assert (mantissa == 0).all() and not torch.equal(s_ue8m0, quantize(w)[1])
