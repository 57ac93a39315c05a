"""FP8 on a torch other than the one `make test` pins: what it raises is a fallback, not a crash.

The GPU machine's torch is 2.11 and `make test`'s 2.13, and the block-scaled GEMM's Python
surface moved between releases: `F.scaled_mm` and its recipes are recent, their names were
spelled `Blockwise_1x128` before `BlockWise1x128`, and a keyword may be missing. Each stand-in
below is such a torch, made by replacing those names for one test. An engine meeting one must
serve FP8 by the next forward that runs (fp8_gemm.REFUSALS: the one call, then the loop of
`torch._scaled_mm`, then dequant), saying why, rather than stop at load. A forward that runs
and computes wrongly still stops the engine (tests/unit/engine/quant/test_fp8.py).
"""

from __future__ import annotations

import enum
import logging

import pytest
import torch
import torch.nn.functional as F

from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.quant import fp8, fp8_gemm
from tests.unit.engine.quant.test_fp8 import emulate_blockwise, make_fp8_copy, one_gemm_layers

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")


def no_scaled_mm(monkeypatch: pytest.MonkeyPatch) -> str:
    """A torch before `F.scaled_mm` (2.9 and earlier): neither it nor its recipes."""
    monkeypatch.delattr(F, "scaled_mm")
    monkeypatch.delattr(F, "ScalingType")
    return "AttributeError"


def other_signature(monkeypatch: pytest.MonkeyPatch) -> str:
    """A `scaled_mm` whose output dtype keyword has another name."""

    def scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, *, out_dtype=None):
        raise AssertionError("not reached: the call has output_dtype")

    monkeypatch.setattr(F, "scaled_mm", scaled_mm)
    return "TypeError"


def kernel_not_built(monkeypatch: pytest.MonkeyPatch) -> str:
    """A build without the block-scaled kernel."""

    def scaled_mm(*args, **kwargs):
        raise NotImplementedError("scaled_mm: BlockWise recipes are not built in this torch")

    monkeypatch.setattr(F, "scaled_mm", scaled_mm)
    return "NotImplementedError"


OLDER_TORCHES = [no_scaled_mm, other_signature, kernel_not_built]


@pytest.mark.parametrize("older", OLDER_TORCHES)
def test_the_one_call_trial_falls_back_on_what_an_older_torch_raises(monkeypatch, caplog, older):
    """`blockwise_supported`'s trial call on a 9.x device: whatever the torch raises, the
    device gets the loop, and the warning names the error."""
    raised = older(monkeypatch)
    monkeypatch.setattr(fp8_gemm, "_blockwise_on", {})
    caplog.set_level(logging.WARNING, logger=fp8_gemm.__name__)
    assert not fp8_gemm._blockwise_runs(CPU)
    assert f"no one-call block-scaled GEMM on cpu ({raised}" in caplog.text


@pytest.mark.parametrize("older", OLDER_TORCHES)
def test_the_start_up_probe_gives_refused_layers_the_loop(monkeypatch, caplog, older):
    """Layers set to the one call (a 9.x device whose trial passed) whose call the torch then
    refuses: the probe moves them to the loop, which computes the same arithmetic."""
    model = one_gemm_layers((256, 384), (128, 256))
    assert fp8.set_gemm(model, "scaled_mm", capability=(9, 0))["scaled_mm"] == 2
    x = torch.randn(3, 384)
    want = fp8_gemm.per_block_linear(x, model[0].weight, model[0].weight_scale_inv, model[0].bias)
    raised = older(monkeypatch)
    counts = fp8.probe_scaled_mm(model, CPU, torch.float32)
    assert counts == {"scaled_mm": 0, "scaled_mm_per_block": 2, "dequant": 0}
    assert f"one block-scaled scaled_mm refused on cpu ({raised}" in caplog.text
    torch.testing.assert_close(model[0](x), want)


def test_the_loop_refused_too_leaves_dequant(monkeypatch, caplog):
    """A torch whose `_scaled_mm` has another signature as well: every layer dequantizes."""
    model = one_gemm_layers((256, 384))
    fp8.set_gemm(model, "scaled_mm", capability=(9, 0))
    no_scaled_mm(monkeypatch)
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, *, scale_a, scale_b: a @ b)
    counts = fp8.probe_scaled_mm(model, CPU, torch.float32)
    assert counts == {"scaled_mm": 0, "scaled_mm_per_block": 0, "dequant": 1}
    assert "_scaled_mm per block refused on cpu (TypeError" in caplog.text


def test_the_recipes_are_found_by_their_older_spelling(monkeypatch):
    """The first `F.scaled_mm` spelled its recipes `Blockwise_1x128` and `Blockwise_128x128`:
    the one call finds them and runs, no fallback."""

    class ScalingType(enum.Enum):
        Tensorwise = 0
        Rowwise = 1
        Blockwise_1x128 = 4
        Blockwise_128x128 = 5

    seen = []

    def scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, *, output_dtype):
        seen.append((recipe_a, recipe_b))
        return emulate_blockwise(mat_a, mat_b, scale_a, scale_b, output_dtype)

    monkeypatch.setattr(F, "ScalingType", ScalingType)
    monkeypatch.setattr(F, "scaled_mm", scaled_mm)
    monkeypatch.setattr(fp8_gemm, "_blockwise_on", {})
    assert fp8_gemm._blockwise_runs(CPU)
    model = one_gemm_layers((256, 384))
    fp8.set_gemm(model, "scaled_mm", capability=(9, 0))
    assert fp8.probe_scaled_mm(model, CPU, torch.float32)["scaled_mm"] == 1
    assert seen[-1] == (ScalingType.Blockwise_1x128, ScalingType.Blockwise_128x128)


def test_an_engine_on_a_torch_whose_loop_is_refused_loads_and_serves(tmp_path, monkeypatch):
    """The FP8 engine at load under --fp8-gemm scaled_mm on such a torch (the CPU has the loop):
    it starts, its Linears dequantize, and it computes as an engine told --fp8-gemm dequant."""
    fp8_dir = make_fp8_copy(tmp_path / "fp8")
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, *, scale_a, scale_b: a @ b)
    runner = ModelRunner(str(fp8_dir), fp8_gemm="scaled_mm")
    layers = fp8.fp8_layers(runner.model).values()
    assert layers and {layer.gemm for layer in layers} == {"dequant"}
    reference = ModelRunner(str(fp8_dir), fp8_gemm="dequant")
    ids = torch.tensor([runner.tokenizer.encode("37+45=")])
    with torch.inference_mode():
        got, want = runner.model(ids).logits, reference.model(ids).logits
    torch.testing.assert_close(got, want)
