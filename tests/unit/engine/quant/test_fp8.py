"""FP8 rollout in the engine (engine/quant/fp8.py, engine/quant/fp8_gemm.py): the block-wise e4m3 cast and
its error bound, the W8A8 forwards against the same arithmetic in float64 (the per-block loop as
it runs on the CPU; the one block-scaled GEMM through torch's own checks of its CUDA operands and
an emulation of the kernel, since the CPU has no such kernel), which forward each device and
shape gets, loading an FP8 checkpoint (examples/arith/make_fp8.py's copy of the arith model),
the engine's per-token log-probs against the fp32 model's, and weight updates cast into the FP8
layers. One test runs the one GEMM on a real GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from millstream.common.errors import MillstreamError
from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.quant import fp8, fp8_gemm
from millstream.engine.scheduler import RequestError
from millstream.engine.weights import WeightLoader

pytestmark = pytest.mark.timeout(120)

ARITH = Path(__file__).resolve().parents[4] / "examples" / "arith"
EOS = 258  # <|im_end|>, the arith model's eos
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_fp8_copy(out: Path, model_dir: Path = ARITH / "model") -> Path:
    """examples/arith/make_fp8.py's FP8 copy of `model_dir` in `out`."""
    spec = importlib.util.spec_from_file_location("arith_make_fp8", ARITH / "make_fp8.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_fp8(model_dir, out)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_copy(tmp_path_factory.mktemp("arith-fp8"))


def blocky_weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Blocks of very different magnitudes, a zero block and values deep in e4m3's subnormals."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen)
    for i in range(math.ceil(out / 128)):
        for j in range(math.ceil(inp / 128)):
            w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= 10.0 ** (i - 2 * j)
    w[:128, 128:256] = 0.0
    w[5, :20] = 1e-7
    return w


@pytest.mark.parametrize("shape", [(200, 300), (64, 64), (256, 128), (32, 64), (129, 1)])
def test_the_round_trip_is_within_e4m3_precision(shape):
    """|w - q * s| <= |w| / 16 + s / 1024: half a step of e4m3's 3 mantissa bits in its normal
    range, half the subnormal step 2^-9 below it (the bound of engine/quant/fp8.py's docstring);
    partial blocks (dims not a multiple of 128) are scaled by their own absmax."""
    w = blocky_weight(*shape)
    q, scale_inv = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape
    assert scale_inv.dtype == torch.float32
    assert tuple(scale_inv.shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    s = fp8.expand_scales(scale_inv, shape, fp8.BLOCK)
    back = fp8.dequantize(q, scale_inv)
    error = (w - back).abs()
    assert (error <= w.abs() / 16 + s / 1024).all()
    assert float((error / (w.abs() / 16 + s / 1024)).max()) > 0.5  # the bound is tight
    assert back[:128, 128:256].eq(0).all()  # a zero block stays zero
    # each block's largest value is 448 steps of its scale: it comes back exactly
    blocks = fp8._blocks(w.abs(), fp8.BLOCK).amax(dim=(1, 3))
    assert torch.allclose(scale_inv * 448, blocks.clamp(min=1e-12), rtol=1e-6)
    rel = ((w - back).norm() / w.norm()).item()
    assert 0 < rel < 1 / 16


def w8a8_reference(
    x_MK: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The W8A8 arithmetic in float64: x quantized per token per 128-column group (as the
    forwards do), times the dequantized weight, plus the bias."""
    m, k = x_MK.shape
    x_q, scale_MG = fp8.quantize_activations(x_MK, 128)
    groups = scale_MG.shape[1]
    x_deq = (x_q.double().view(m, groups, 128) * scale_MG.double()[:, :, None]).view(m, -1)
    want = x_deq[:, :k] @ fp8.dequantize(q, scale_inv).double().t()
    return want if bias is None else want + bias.double()


def assert_w8a8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within fp32 summation of the float64 W8A8 arithmetic: 1e-5 of each value, or of the
    largest output where an output's terms cancel."""
    atol = 1e-5 * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=atol)


def emulate_blockwise(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """What cuBLAS's BlockWise1x128 x BlockWise128x128 GEMM computes from its operands (torch's
    test_scaled_mm_block_wise_numerics holds the kernel to the same emulation): for each
    128-column block j of K, the fp8 products summed in fp32, times scale_a[m, j] (the row's
    group) and scale_b[j, n // 128] (the weight block), summed over j in fp32. Rows of scale_b
    past K/128 (the padding to L4) are never read."""
    (m, k), n = mat_a.shape, mat_b.shape[1]
    out = torch.zeros(m, n, device=mat_a.device)
    for j in range(k // 128):
        cols = slice(j * 128, (j + 1) * 128)
        partial = mat_a[:, cols].float() @ mat_b[cols].float()
        out += partial * scale_a[:, j : j + 1] * scale_b[j].repeat_interleave(128)[:n]
    return out.to(output_dtype)


def on_meta(t: torch.Tensor) -> torch.Tensor:
    """The same shape, strides and dtype on the meta device, where torch checks the operands
    of `scaled_mm` as it does for CUDA (`_meta_registrations.device_hint` says "cuda")."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def gemm_calls(monkeypatch: pytest.MonkeyPatch, compute=emulate_blockwise) -> list[str]:
    """`F.scaled_mm` and `torch._scaled_mm` (what fp8_gemm calls) replaced by counting wrappers,
    the calls listed in order. scaled_mm's operands go through torch's own checks (on meta
    copies), then `compute` gives its result: the CPU has no block-scaled kernel to run."""
    calls: list[str] = []
    real_scaled_mm, real_v1 = F.scaled_mm, torch._scaled_mm

    def scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, *, output_dtype):
        calls.append("scaled_mm")
        assert (recipe_a, recipe_b) == (
            F.ScalingType.BlockWise1x128,
            F.ScalingType.BlockWise128x128,
        )
        checked = real_scaled_mm(
            *map(on_meta, (mat_a, mat_b, scale_a)),
            recipe_a,
            on_meta(scale_b),
            recipe_b,
            output_dtype=output_dtype,
        )
        out = compute(mat_a, mat_b, scale_a, scale_b, output_dtype)
        assert (out.shape, out.dtype) == (checked.shape, checked.dtype)
        return out

    def v1(*args, **kwargs):
        calls.append("_scaled_mm")
        return real_v1(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_mm", scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", v1)
    return calls


def test_the_per_block_forward_is_the_block_fp8_arithmetic():
    """The loop (fp8_gemm.per_block_linear, the CPU's W8A8) against float64: x quantized per
    token per 128-column group, times the dequantized weight, plus the bias; partial blocks in
    both dimensions."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 208, generator=gen) * torch.linspace(0.1, 10, 208)
    w = blocky_weight(80, 208, seed=2)
    bias = torch.randn(80, generator=gen)
    q, scale_inv = fp8.quantize(w)
    got = fp8_gemm.per_block_linear(x, q, scale_inv, bias)
    want = w8a8_reference(x.reshape(6, 208), q, scale_inv, bias)
    assert got.shape == (2, 3, 80)
    torch.testing.assert_close(got.double().view(6, 80), want, rtol=1e-5, atol=1e-5)
    plain = x.reshape(6, 208).double() @ w.double().t() + bias.double()
    assert (got.double().view(6, 80) - plain).abs().max() > 1e-3  # activations quantized too


@pytest.mark.parametrize(
    ("n", "k", "m"),
    # K/128 of 3, 7 (Qwen2.5-0.5B's hidden 896) and 38 (its MLP's 4864): scale_b padded to L4
    # = 4, 8, 40; M of 6, 1 and 3 padded to 8, 4 and 4; 4 blocks: no padding.
    [(256, 384, 6), (128, 896, 1), (256, 4864, 3), (384, 512, 8)],
)
def test_the_one_gemm_operands_pass_torchs_checks_and_compute_the_arithmetic(n, k, m):
    """fp8_gemm.blockwise_operands: the layouts torch's `scaled_mm` wants for BlockWise1x128 x
    BlockWise128x128 on CUDA (its meta checks pass them and refuse a row-major scale_a or
    unpadded weight scales), and the kernel's arithmetic on them (emulated) is the W8A8
    arithmetic in float64. The CPU has no such kernel: torch 2.13 refuses the call there."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 10, k)
    q, scale_inv = fp8.quantize(blocky_weight(n, k, seed=3))
    mat_a, scale_a, mat_b, scale_b = fp8_gemm.blockwise_operands(x, q, scale_inv)
    rows, k_blocks = m + (-m % 4), k // 128
    l4 = k_blocks + (-k_blocks % 4)
    assert (mat_a.dtype, mat_a.shape, mat_a.stride()) == (fp8.FP8_DTYPE, (rows, k), (k, 1))
    assert (mat_b.dtype, mat_b.shape, mat_b.stride()) == (fp8.FP8_DTYPE, (k, n), (1, k))
    assert (scale_a.shape, scale_a.stride()) == ((rows, k_blocks), (1, rows))
    assert (scale_b.shape, scale_b.stride()) == ((l4, n // 128), (1, l4))
    assert torch.equal(scale_b[:k_blocks], scale_inv.t()) and scale_b[k_blocks:].eq(0).all()
    assert mat_a[m:].float().eq(0).all()
    blockwise = (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)

    def check(scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
        a, b = blockwise
        metas = [on_meta(t) for t in (mat_a, mat_b, scale_a, scale_b)]
        return F.scaled_mm(*metas[:3], a, metas[3], b, output_dtype=torch.bfloat16)

    assert check(scale_a, scale_b).shape == (rows, n)
    with pytest.raises(RuntimeError, match="1x128 x 128x128 blockwise scaling"):
        check(scale_a.contiguous(), scale_b)
    if k_blocks % 4:
        with pytest.raises(RuntimeError, match="1x128 x 128x128 blockwise scaling"):
            check(scale_a, scale_inv.t())
    got = emulate_blockwise(mat_a, mat_b, scale_a, scale_b, torch.float32)[:m]
    assert_w8a8(got, w8a8_reference(x, q, scale_inv, None))
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        F.scaled_mm(mat_a, mat_b, scale_a, blockwise[0], scale_b, blockwise[1])


def one_gemm_layers(*shapes: tuple[int, int], bias: bool = True) -> torch.nn.ModuleList:
    """Fp8Linear layers of these [out, in] shapes, blocky weights, with or without a bias."""
    gen = torch.Generator().manual_seed(4)
    layers = []
    for i, (n, k) in enumerate(shapes):
        b = torch.randn(n, generator=gen) if bias else None
        layers.append(fp8.Fp8Linear(*fp8.quantize(blocky_weight(n, k, seed=i)), b))
    return torch.nn.ModuleList(layers)


def test_the_one_gemm_path_is_one_gemm_call_per_linear(monkeypatch):
    """Where the device has the block-scaled GEMM (compute capability 9.x), a Linear's forward
    is one `F.scaled_mm` call, and nothing else multiplies; the loop it replaces makes K/128
    calls (3 here), which this count refuses. Both give the W8A8 arithmetic."""
    calls = gemm_calls(monkeypatch)
    model = one_gemm_layers((256, 384))
    assert fp8.set_gemm(model, "scaled_mm", capability=(9, 0))["scaled_mm"] == 1
    layer = model[0]
    x = torch.randn(2, 5, 384, generator=torch.Generator().manual_seed(5))
    want = w8a8_reference(x.reshape(10, 384), layer.weight, layer.weight_scale_inv, layer.bias)
    got = layer(x)
    assert calls == ["scaled_mm"]
    assert got.shape == (2, 5, 256)
    assert_w8a8(got.view(10, 256), want)
    # in bf16: the bias added to the fp32 output, then one rounding (2^-8 of each value)
    x16 = x.bfloat16()
    got16 = layer(x16).view(10, 256).double()
    want16 = w8a8_reference(
        x16.float().reshape(10, 384), layer.weight, layer.weight_scale_inv, layer.bias
    )
    assert got16.ne(want16).any()
    assert ((got16 - want16).abs() <= want16.abs() * 2**-8 + 1e-5 * want16.abs().max()).all()
    assert calls == ["scaled_mm"] * 2

    calls.clear()
    layer.gemm = "scaled_mm_per_block"
    assert_w8a8(layer(x).view(10, 256), want)
    assert calls == ["_scaled_mm"] * 3  # the old path: not one call


@pytest.mark.parametrize(
    ("shape", "gemm"),
    [
        ((256, 384), "scaled_mm"),  # whole blocks
        ((144, 384), "scaled_mm_per_block"),  # N ends in a partial block
        ((256, 208), "scaled_mm_per_block"),  # K ends in a partial block
        ((200, 384), "dequant"),  # N not a multiple of 16: CUDA's _scaled_mm refuses it
        ((256, 40), "dequant"),  # nor K
    ],
)
def test_a_layer_the_one_gemm_cannot_take_falls_back_and_computes_the_same(
    monkeypatch, shape, gemm
):
    calls = gemm_calls(monkeypatch)
    model = one_gemm_layers(shape)
    counts = fp8.set_gemm(model, "scaled_mm", capability=(9, 0))
    assert counts == {g: int(g == gemm) for g in fp8_gemm.LAYER_GEMMS}
    layer = model[0]
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(6))
    got = layer(x).double()
    k_blocks = math.ceil(shape[1] / 128)
    expected_calls = {"scaled_mm": ["scaled_mm"], "scaled_mm_per_block": ["_scaled_mm"] * k_blocks}
    assert calls == expected_calls.get(gemm, [])
    if gemm == "dequant":  # W8A16: the activations as they are
        want = x.double() @ fp8.dequantize(layer.weight, layer.weight_scale_inv).double().t()
        want += layer.bias.double()
    else:
        want = w8a8_reference(x, layer.weight, layer.weight_scale_inv, layer.bias)
    assert_w8a8(got, want)


@pytest.mark.parametrize(
    ("capability", "auto", "gemm"),
    [
        (None, "dequant", "scaled_mm_per_block"),  # the CPU: the loop under --fp8-gemm scaled_mm
        ((8, 6), "dequant", "scaled_mm_per_block"),  # Ampere: no FP8 tensor cores
        ((8, 9), "scaled_mm", "scaled_mm_per_block"),  # Ada: FP8, no block-scaled cuBLAS
        ((9, 0), "scaled_mm", "scaled_mm"),  # Hopper (H100, H200)
        ((10, 0), "scaled_mm", "scaled_mm_per_block"),  # Blackwell: torch gates it to sm90
        ((12, 0), "scaled_mm", "scaled_mm_per_block"),
    ],
)
def test_which_gemm_each_compute_capability_gets(capability, auto, gemm):
    device = torch.device("cpu" if capability is None else "cuda")
    assert fp8.choose_gemm("auto", device, capability) == auto
    assert fp8.choose_gemm("dequant", device, capability) == "dequant"
    model = one_gemm_layers((256, 384), (128, 256))
    expected = {g: 2 * (g == gemm) for g in fp8_gemm.LAYER_GEMMS}
    assert fp8.set_gemm(model, "scaled_mm", capability=capability) == expected
    assert {layer.gemm for layer in model} == {gemm}
    assert fp8.set_gemm(model, "dequant", capability=capability)["dequant"] == 2


def test_a_device_whose_torch_refuses_the_one_gemm_gets_the_loop(monkeypatch, caplog):
    """On a CUDA device of compute capability 9.x, `blockwise_supported` also asks one small
    call, once per device (torch wants cuBLASLt >= 12.9 too, which only a call shows). The
    trial runs here on the CPU, whose torch refuses the call as an older cuBLASLt would."""
    tried: list[int] = []
    real = F.scaled_mm
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **k: tried.append(1) or real(*a, **k))
    monkeypatch.setattr(fp8_gemm, "_blockwise_on", {})
    cpu = torch.device("cpu")
    assert not fp8_gemm._blockwise_runs(cpu) and not fp8_gemm._blockwise_runs(cpu)
    assert tried == [1]
    assert "no one-call block-scaled GEMM on cpu (ValueError: Invalid scaling" in caplog.text

    cuda = torch.device("cuda")  # no GPU needed: the capability and the trial stand in
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_gemm, "_blockwise_on", {"cuda": False})
    assert not fp8_gemm.blockwise_supported(cuda)
    monkeypatch.setattr(fp8_gemm, "_blockwise_on", {"cuda": True})
    assert fp8_gemm.blockwise_supported(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert not fp8_gemm.blockwise_supported(cuda)


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
        ({"quant_method": "fp8"}, "weight_block_size None"),
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt 'e5m2'"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            "activation_scheme 'static'",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
            "scale_fmt 'ue8m0'",
        ),
    ],
)
def test_a_scheme_not_served_is_an_error_naming_it(quantization_config, message):
    with pytest.raises(MillstreamError) as info:
        fp8.block_of(quantization_config, "/m")
    assert str(info.value).startswith("--model-path /m: config.json quantization_config")
    assert message in str(info.value)
    assert fp8.block_of(None, "/m") is None


def test_the_flag_offers_the_forwards_there_are():
    from millstream.engine.config import FP8_GEMMS, parse_engine_config

    assert FP8_GEMMS == fp8.GEMMS  # the config imports no torch, so it repeats them
    assert parse_engine_config(["--model-path", "/m"]).fp8_gemm == "auto"


def test_the_fp8_copy_is_the_checkpoint_layout(fp8_dir):
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (fp8_dir / name).read_bytes() == (ARITH / "model" / name).read_bytes()
    from safetensors.torch import load_file

    source = load_file(ARITH / "model" / "model.safetensors")
    copied = load_file(fp8_dir / "model.safetensors")
    scaled = {n.removesuffix("_scale_inv") for n in copied if n.endswith("_scale_inv")}
    assert len(scaled) == 2 * len(LINEARS)
    for name, tensor in source.items():
        if name in scaled:  # transformers' finegrained_fp8 names: <module>.weight_scale_inv
            q, scale_inv = copied[name], copied[name + "_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
            assert tuple(scale_inv.shape) == fp8.scale_shape(tensor.shape, fp8.BLOCK)
        else:  # embeddings, norms, biases: as they were
            assert torch.equal(copied[name], tensor), name
    assert {n.split(".")[-2] for n in scaled} == set(LINEARS)


def test_the_engine_loads_its_linears_in_fp8(fp8_dir):
    runner = ModelRunner(str(fp8_dir))
    assert runner.quantization == "fp8" and runner.fp8_gemm == "dequant"  # the CPU's
    layers = fp8.fp8_layers(runner.model)
    assert sorted({n.split(".")[-2] for n in layers}) == sorted(LINEARS)
    assert len(layers) == 2 * len(LINEARS)
    q_proj = runner.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, fp8.Fp8Linear) and q_proj.weight.dtype == torch.float8_e4m3fn
    assert q_proj.bias is not None and q_proj.bias.dtype == torch.float32
    assert runner.model.lm_head.weight.dtype == torch.float32  # tied to the embeddings
    assert runner.model.model.norm.weight.dtype == torch.float32
    assert runner.weight_bytes < ModelRunner(str(ARITH / "model")).weight_bytes
    plain = ModelRunner(str(ARITH / "model"))
    assert plain.quantization is None and plain.fp8_gemm is None


def test_a_broken_fp8_checkpoint_is_an_error_naming_the_tensor(fp8_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(fp8_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        MillstreamError, match=r"up_proj.weight_scale_inv is \[1, 1\], not \[2, 1\]"
    ):
        ModelRunner(str(broken))


def test_a_scaled_mm_that_computes_otherwise_stops_the_engine(fp8_dir, monkeypatch):
    """The start-up probe: what a GPU whose _scaled_mm misbehaves would meet (the arith model's
    Linears are not whole 128-blocks: the loop)."""
    monkeypatch.setattr(fp8_gemm, "per_block_linear", lambda x, *args: torch.zeros_like(x))
    with pytest.raises(MillstreamError, match=r"per block\): on cpu it is 1 \(relative\) off"):
        ModelRunner(str(fp8_dir), fp8_gemm="scaled_mm")


def test_the_probe_runs_the_one_gemm_where_it_is_used(monkeypatch, caplog):
    """probe_scaled_mm checks the first layer of each W8A8 forward in use: with the one GEMM
    selected, that call (its operands through torch's checks, the kernel emulated) is what it
    runs; a kernel that computes otherwise stops the engine naming it, one that refuses to run
    gives its layers the loop (tests/unit/engine/quant/test_fp8_fallback.py: what other torches raise)."""
    calls = gemm_calls(monkeypatch)
    model = one_gemm_layers((256, 384), (128, 896), (144, 256))
    counts = fp8.set_gemm(model, "scaled_mm", capability=(9, 0))
    assert counts == {"scaled_mm": 2, "scaled_mm_per_block": 1, "dequant": 0}
    assert fp8.probe_scaled_mm(model, torch.device("cpu"), torch.float32) == counts
    assert calls == ["scaled_mm"] + ["_scaled_mm"] * 2  # one of each forward in use

    def unscaled_weights(mat_a, mat_b, scale_a, scale_b, output_dtype):
        return emulate_blockwise(mat_a, mat_b, scale_a, torch.ones_like(scale_b), output_dtype)

    gemm_calls(monkeypatch, compute=unscaled_weights)
    with pytest.raises(MillstreamError, match=r"\(one block-scaled scaled_mm\): on cpu it is"):
        fp8.probe_scaled_mm(model, torch.device("cpu"), torch.float32)

    def refused(*args):
        raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling only supported ...")

    gemm_calls(monkeypatch, compute=refused)
    counts = fp8.probe_scaled_mm(model, torch.device("cpu"), torch.float32)
    assert counts == {"scaled_mm": 0, "scaled_mm_per_block": 3, "dequant": 0}
    assert "one block-scaled scaled_mm refused on cpu (NotImplementedError: DeepSeek" in caplog.text


def response_logprobs(runner: ModelRunner) -> torch.Tensor:
    """Teacher-forced log-probs of each eval problem's right answer and eos (708 tokens)."""
    rows = [json.loads(line) for line in (ARITH / "data" / "eval.jsonl").read_text().splitlines()]
    by_shape: dict[tuple[int, int], list[list[int]]] = {}
    for row in rows:
        prompt = runner.tokenizer.encode(row["prompt"])
        answer = [*runner.tokenizer.encode(row["label"]), EOS]
        by_shape.setdefault((len(prompt), len(answer)), []).append(prompt + answer)
    out = []
    with torch.inference_mode():
        for (prompt_len, _), sequences in sorted(by_shape.items()):
            ids_BT = torch.tensor(sequences)
            logp_BTV = runner.model(input_ids=ids_BT).logits.float().log_softmax(-1)
            targets_BR = ids_BT[:, prompt_len:]
            logp_BR = logp_BTV[:, prompt_len - 1 : -1].gather(-1, targets_BR[..., None])
            out.append(logp_BR.flatten())
    return torch.cat(out)


@pytest.mark.parametrize(
    ("gemm", "mean_below", "max_below"),
    # measured (CPU, float32 activations): dequant 0.018 mean, 0.29 max; scaled_mm 0.037,
    # 0.81 (the engine in bf16 without FP8: 0.0058, 0.10). Hidden size 64: one block per row,
    # so the CPU's scaled_mm is the per-block loop (one block: one _scaled_mm per Linear).
    [("dequant", 0.03, 0.5), ("scaled_mm", 0.06, 1.2)],
)
def test_fp8_logprobs_are_near_the_fp32_models(fp8_dir, gemm, mean_below, max_below):
    """The FP8 engine's per-token log-probs against the fp32 model's on the same weights: off
    by FP8's rounding (so the FP8 path is what ran), and no more than the stated tolerance."""
    reference = response_logprobs(ModelRunner(str(ARITH / "model")))
    runner = ModelRunner(str(fp8_dir), fp8_gemm=gemm)
    ran = {"dequant": "dequant", "scaled_mm": "scaled_mm_per_block"}[gemm]
    assert {layer.gemm for layer in fp8.fp8_layers(runner.model).values()} == {ran}
    gap = (response_logprobs(runner) - reference).abs()
    print(
        f"{gemm}: |FP8 - fp32| over {gap.numel()} tokens: {gap.mean():.4f} mean, {gap.max():.4f} max"
    )
    assert 1e-3 < gap.mean() < mean_below
    assert gap.max() < max_below


def full_precision_update(scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    """What a trainer sends: every weight by its Hugging Face name, moved, in bf16; an FP8
    layer's weight at its full [out, in] shape."""
    gen = torch.Generator().manual_seed(3)
    reference = ModelRunner(str(ARITH / "model"))
    return [
        (name, (p + scale * torch.randn(p.shape, generator=gen)).to(torch.bfloat16))
        for name, p in reference.model.named_parameters()
    ]


def test_a_bf16_update_lands_cast_to_fp8(fp8_dir):
    runner = ModelRunner(str(fp8_dir))
    loader = WeightLoader(runner.model)
    update = full_precision_update()
    names = [n for n, _ in update]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any(n.endswith("_scale_inv") for n in names)
    loader.check_specs(names, [list(t.shape) for _, t in update])  # before a broadcast
    loader.check(update)
    loader.copy_in(update)
    given = dict(update)
    layers = fp8.fp8_layers(runner.model)
    for name, layer in layers.items():
        q, scale_inv = fp8.quantize(given[name])
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale_inv, scale_inv), name
    params = dict(runner.model.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(params[name], given[name].float())
    # and it computes with them: the dequantized layer is the new weight, FP8-rounded
    layer = layers["model.layers.0.mlp.down_proj.weight"]
    back = fp8.dequantize(layer.weight, layer.weight_scale_inv)
    new = given["model.layers.0.mlp.down_proj.weight"].float()
    assert (back - new).abs().max() <= new.abs().max() / 16


def test_an_fp8_update_with_its_scales_is_taken_as_is(fp8_dir):
    """Miles' megatron sender quantizes before sending: weight and weight_scale_inv together."""
    runner = ModelRunner(str(fp8_dir))
    loader = WeightLoader(runner.model)
    name = "model.layers.1.mlp.gate_proj.weight"
    q, scale_inv = fp8.quantize(torch.randn(256, 64))
    update = [(name, q), (name + "_scale_inv", scale_inv)]
    loader.check(update)
    loader.copy_in(update)
    layer = fp8.fp8_layers(runner.model)[name]
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, scale_inv)


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (
            [
                (
                    "model.layers.0.self_attn.q_proj.weight",
                    torch.zeros(64, 64, dtype=torch.float8_e4m3fn),
                )
            ],
            "FP8 without its model.layers.0.self_attn.q_proj.weight_scale_inv",
        ),
        (
            [("model.layers.0.self_attn.q_proj.weight_scale_inv", torch.ones(1, 1))],
            "block scales come with their float8_e4m3fn weight",
        ),
        (
            [("model.norm.weight", torch.ones(64, dtype=torch.float8_e4m3fn))],
            "model.norm.weight: float8_e4m3fn, but that parameter is not FP8",
        ),
        (
            [("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 32))],
            r"q_proj.weight is \[64, 64\] here, got \[64, 32\]",
        ),
    ],
)
def test_an_update_that_does_not_fit_the_fp8_layers_is_refused(fp8_dir, update, message):
    loader = WeightLoader(ModelRunner(str(fp8_dir)).model)
    with pytest.raises(RequestError, match=message):
        loader.check(update)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("n", "k", "m", "dtype"),
    # Qwen2.5-0.5B's q_proj (896 x 896, K/128 = 7: scale_b padded to 8), its down_proj
    # (896 x 4864, K/128 = 38: padded to 40) and up_proj; decode (M = 1, 5) and prefill rows.
    [
        (896, 896, 1, torch.bfloat16),
        (896, 4864, 5, torch.bfloat16),
        (4864, 896, 300, torch.bfloat16),
        (384, 512, 7, torch.float32),
    ],
)
def test_the_one_gemm_on_cuda_is_the_block_fp8_arithmetic(monkeypatch, n, k, m, dtype):
    """The one block-scaled GEMM on a real GPU (compute capability 9.x; elsewhere it skips,
    naming why): one `F.scaled_mm` call per forward, within the output dtype's rounding of the
    W8A8 arithmetic in float64, and the start-up probe passes it. Prints the time of a forward
    by each path against a bf16 Linear of the same shape, for the record."""
    cuda = torch.device("cuda")
    if not fp8_gemm.blockwise_supported(cuda):
        pytest.skip(
            f"no one-call block-scaled GEMM on {torch.cuda.get_device_name()} "
            f"(compute capability {torch.cuda.get_device_capability()}, torch {torch.__version__})"
        )
    gen = torch.Generator().manual_seed(7)
    q, scale_inv = fp8.quantize(torch.randn(n, k, generator=gen) * 0.05)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    model = torch.nn.ModuleList([fp8.Fp8Linear(q, scale_inv, bias)]).to(cuda)
    layer = model[0]
    assert fp8.set_gemm(model, "scaled_mm")["scaled_mm"] == 1
    fp8.probe_scaled_mm(model, cuda, dtype)
    x = torch.randn(m, k, generator=gen).to(cuda, dtype)

    calls: list[int] = []
    real = F.scaled_mm
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = layer(x)
    monkeypatch.undo()
    assert calls == [1] and got.dtype == dtype and got.shape == (m, n)
    want = w8a8_reference(x.float().cpu(), q, scale_inv, bias.float())
    error = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    print(f"\none GEMM, {m} x {k} -> {n} in {dtype}: {error:.2e} relative to the float64 W8A8")
    assert error < (1e-2 if dtype == torch.bfloat16 else 1e-3)

    def ms(forward) -> float:
        for _ in range(3):
            forward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            forward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    times = {}
    with torch.inference_mode():
        for gemm in fp8_gemm.LAYER_GEMMS:
            layer.gemm = gemm
            times[gemm] = ms(lambda: layer(x))
        w = fp8.dequantize(layer.weight, layer.weight_scale_inv).to(dtype)
        times["bf16 Linear" if dtype == torch.bfloat16 else "fp32 Linear"] = ms(
            lambda: F.linear(x, w, layer.bias)
        )
    print("  ms a forward: " + ", ".join(f"{g} {t:.3f}" for g, t in times.items()))
