"""On-policy distillation from a teacher engine: the logprobs the trainer gets over HTTP equal
the ones of the same model loaded in the trainer, token for token."""

from __future__ import annotations

import asyncio

import pytest
import torch

from millstream.common.config import parse_run_config
from millstream.common.errors import MillstreamError
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.teacher import TeacherClient
from tests.support.engine_proc import EngineProcess
from tests.unit.trainer.backends.test_torch_backend import _samples

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_teacher_engine_logprobs_equal_a_local_forward(tiny_model_dir, tmp_path, temperature):
    cfg = parse_run_config(
        ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         "--rollout-temperature", str(temperature)]
    )  # fmt: skip
    local = TorchBackend(cfg, tiny_model_dir, ref_dir=None, total_steps=1)
    engine = EngineProcess(tiny_model_dir, tmp_path)
    try:

        async def score():
            client = TeacherClient(engine.url, cfg.rollout.logprob_temperature)
            try:
                return await client.score(_samples())
            finally:
                await client.close()

        scored = asyncio.run(score())
    finally:
        engine.stop()
    for s, want in zip(scored, local.logprobs(_samples()), strict=True):
        assert len(s.teacher_logprobs) == s.response_len
        torch.testing.assert_close(torch.tensor(s.teacher_logprobs), want, atol=1e-4, rtol=0)


def test_an_unreachable_teacher_is_a_clear_error():
    async def score():
        client = TeacherClient("http://127.0.0.1:9", 1.0, timeout_s=5)
        try:
            await client.score(_samples())
        finally:
            await client.close()

    with pytest.raises(MillstreamError, match=r"teacher engine http://127\.0\.0\.1:9 unreachable"):
        asyncio.run(score())
