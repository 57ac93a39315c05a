"""FP8 rollout in the engine (engine/fp8.py): the block-wise e4m3 cast and its error bound, the
W8A8 forward against the same arithmetic in float64, loading an FP8 checkpoint
(examples/arith/make_fp8.py's copy of the arith model), the engine's per-token log-probs
against the fp32 model's, and weight updates cast into the FP8 layers."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from millstream.common.errors import MillstreamError
from millstream.engine import fp8
from millstream.engine.model_runner import ModelRunner
from millstream.engine.scheduler import RequestError
from millstream.engine.weights import WeightLoader

pytestmark = pytest.mark.timeout(120)

ARITH = Path(__file__).resolve().parents[2] / "examples" / "arith"
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
    range, half the subnormal step 2^-9 below it (the bound of engine/fp8.py's docstring);
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


def test_the_w8a8_forward_is_the_block_fp8_arithmetic():
    """scaled_mm_linear against float64: x quantized per token per 128-column group, times
    the dequantized weight, plus the bias; partial blocks in both dimensions."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 208, generator=gen) * torch.linspace(0.1, 10, 208)
    w = blocky_weight(80, 208, seed=2)
    bias = torch.randn(80, generator=gen)
    q, scale_inv = fp8.quantize(w)
    got = fp8.scaled_mm_linear(x, q, scale_inv, bias)
    x_q, scale_MG = fp8.quantize_activations(x.reshape(6, 208), 128)
    x_deq = (x_q.double().view(6, 2, 128) * scale_MG.double()[:, :, None]).view(6, 256)[:, :208]
    want = x_deq @ fp8.dequantize(q, scale_inv).double().t() + bias.double()
    assert got.shape == (2, 3, 80)
    torch.testing.assert_close(got.double().view(6, 80), want, rtol=1e-5, atol=1e-5)
    plain = x.reshape(6, 208).double() @ w.double().t() + bias.double()
    assert (got.double().view(6, 80) - plain).abs().max() > 1e-3  # activations quantized too


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


def test_scaled_mm_keeps_dequant_where_cuda_would_refuse_the_shape():
    q, scale_inv = fp8.quantize(torch.randn(48, 40))
    model = torch.nn.Sequential(
        fp8.Fp8Linear(q, scale_inv, None), fp8.Fp8Linear(*fp8.quantize(torch.randn(16, 48)), None)
    )
    assert fp8.set_gemm(model, "scaled_mm") == {"scaled_mm": 1, "dequant": 1}  # 40 % 16 != 0
    assert fp8.choose_gemm("auto", torch.device("cpu")) == "dequant"
    assert fp8.choose_gemm("scaled_mm", torch.device("cpu")) == "scaled_mm"


def test_a_scaled_mm_that_computes_otherwise_stops_the_engine(fp8_dir, monkeypatch):
    """The start-up probe: what a GPU whose _scaled_mm misbehaves would meet."""
    monkeypatch.setattr(fp8, "scaled_mm_linear", lambda x, *args: torch.zeros_like(x))
    with pytest.raises(MillstreamError, match=r"off the same arithmetic .* --fp8-gemm dequant"):
        ModelRunner(str(fp8_dir), fp8_gemm="scaled_mm")


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
    # 0.81 (the engine in bf16 without FP8: 0.0058, 0.10). Hidden size 64: one block per row.
    [("dequant", 0.03, 0.5), ("scaled_mm", 0.06, 1.2)],
)
def test_fp8_logprobs_are_near_the_fp32_models(fp8_dir, gemm, mean_below, max_below):
    """The FP8 engine's per-token log-probs against the fp32 model's on the same weights: off
    by FP8's rounding (so the FP8 path is what ran), and no more than the stated tolerance."""
    reference = response_logprobs(ModelRunner(str(ARITH / "model")))
    runner = ModelRunner(str(fp8_dir), fp8_gemm=gemm)
    assert {layer.gemm for layer in fp8.fp8_layers(runner.model).values()} == {gemm}
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
