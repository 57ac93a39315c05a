"""The NCCL update group on real GPUs (`make gpu-check` on a machine with two; skipped with
fewer: NCCL refuses two ranks on one GPU, "Duplicate GPU detected"): this process is the
trainer's rank 0 on its first GPU, a real engine on the second joins the group through the
router, and after each sync the engine generates what the trainer's model gives. The same
handshake on gloo is tests/integration/test_weight_sync.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from millstream.trainer.weights.sync import WeightSync
from tests.integration.test_weight_sync import TOKEN, assert_engine_equals, hf_model
from tests.support.engine_proc import EngineProcess
from tests.support.router_proc import start_router

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.timeout(180)]


def test_an_engine_on_another_gpu_is_synced_over_nccl(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL takes one GPU per rank")
    from millstream.launch.plan import visible_devices

    ids = visible_devices()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ids[1])  # the engine sees the second GPU only
    engine = EngineProcess(
        tiny_model_dir, tmp_path, "--device", "cuda", "--dtype", "float32",
        "--disable-cuda-graph", "--admin-token", TOKEN, "--weight-update-timeout", "60",
        startup_timeout_s=120,
    )  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(ids))
    router = start_router(tmp_path, "--admin-token", TOKEN, "--worker-urls", engine.url)
    loop = asyncio.new_event_loop()
    ws = WeightSync(router.url, admin_token=TOKEN, timeout_s=60, transport="nccl",
                    bucket_bytes=64 * 1024)  # fmt: skip
    try:
        for version in (1, 2):
            model = hf_model(tiny_model_dir, seed=version)
            on_gpu = model.to("cuda:0")
            report = loop.run_until_complete(ws.sync(on_gpu.named_parameters(), version))
            assert report.removed == {} and report.engines == [engine.url]
            assert report.new_group == (version == 1) and "broadcast" in report.seconds
            assert_engine_equals(engine.url, model.to("cpu"), str(version), atol=1e-3)
    finally:
        loop.run_until_complete(ws.close())
        loop.close()
        router.stop()
        engine.stop()
