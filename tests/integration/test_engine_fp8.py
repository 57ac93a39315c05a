"""An engine serving an FP8 checkpoint (examples/arith/make_fp8.py's copy of the arith model):
it says so in /get_server_info, and a weight update in bf16 lands cast to FP8, so the engine then
generates exactly what an FP8 checkpoint made from those weights gives (engine/quant/fp8.py)."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from millstream.engine.executor.model_runner import ModelRunner
from tests.integration.test_engine_weights import assert_matches_hf, engine_greedy, post
from tests.support.engine_proc import EngineProcess, engine_fixtures
from tests.unit.engine.quant.test_fp8 import ARITH, make_fp8_copy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fp8_copy(tmp_path_factory.mktemp("arith-fp8"))


engine, client = engine_fixtures("--weight-version", "v0", model="fp8_dir")


def test_the_engine_says_it_serves_fp8(client: httpx.Client, engine: EngineProcess, fp8_dir):
    info = client.get("/get_server_info").json()
    assert (info["quantization"], info["fp8_gemm"]) == ("fp8", "dequant")  # the CPU's forward
    assert client.get("/get_model_info").json()["quantization"] == "fp8"
    assert_matches_hf(engine_greedy(client, engine), ModelRunner(str(fp8_dir)).model, "v0")


def test_a_bf16_update_over_http_lands_cast_to_fp8(
    client: httpx.Client, engine: EngineProcess, tmp_path: Path
):
    from safetensors.torch import load_file, save, save_file

    original = load_file(ARITH / "model" / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    new = {
        name: (value + 0.05 * torch.randn(value.shape, generator=generator)).to(torch.bfloat16)
        for name, value in original.items()
    }
    names = sorted(new)
    blobs = [
        base64.b64encode(save({n: new[n] for n in names[i : i + 7]})).decode()
        for i in range(0, len(names), 7)
    ]
    body = {"serialized_named_tensors": blobs, "weight_version": "v1"}
    assert post(client, engine, "/update_weights_from_tensor", body)["success"] is True
    # the reference: those weights saved as a checkpoint, then made FP8 by the example script
    moved = tmp_path / "moved"
    shutil.copytree(ARITH / "model", moved)
    save_file(new, moved / "model.safetensors")
    reference = ModelRunner(str(make_fp8_copy(tmp_path / "moved-fp8", moved))).model
    assert_matches_hf(engine_greedy(client, engine), reference, "v1")


def test_an_fp8_checkpoint_from_disk_is_loaded_as_stored(
    client: httpx.Client, engine: EngineProcess, fp8_dir: Path
):
    """/update_weights_from_disk of an FP8 dir: each weight with its weight_scale_inv, as is."""
    body = {"model_path": str(fp8_dir), "weight_version": "v2"}
    assert post(client, engine, "/update_weights_from_disk", body)["success"] is True
    assert_matches_hf(engine_greedy(client, engine), ModelRunner(str(fp8_dir)).model, "v2")
