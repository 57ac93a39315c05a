"""The static KV cache's budget on a GPU (engine/kv/sizing.py `kv_tokens_for`): SGLang's
profile_max_num_token, checked against numbers worked by hand; the GPU's own numbers are
checked by tests/unit/engine/test_engine_gpu.py under `make gpu-check`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from millstream.common.errors import MillstreamError
from millstream.engine.kv.sizing import kv_bytes_per_token, kv_token_budget, kv_tokens_for

GIB = 2**30
# Qwen2.5-7B in bf16: 28 layers x (keys + values) x 4 kv heads x 128 x 2 bytes.
QWEN_7B = SimpleNamespace(
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584
)
QWEN_7B_BYTES = 57344


def test_bytes_per_token_count_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(QWEN_7B, torch.bfloat16) == QWEN_7B_BYTES
    assert kv_bytes_per_token(QWEN_7B, torch.float32) == 2 * QWEN_7B_BYTES


def test_the_budget_is_what_is_free_after_the_weights_less_total_times_one_minus_fraction():
    # An 80 GiB GPU, 60 GiB free once the weights are in, --mem-fraction-static 0.85:
    # 80 x 0.15 = 12 GiB stay free, 60 - 12 = 48 GiB of KV = 48 GiB / 56 KiB tokens.
    assert kv_tokens_for(80 * GIB, 60 * GIB, 0.85, QWEN_7B_BYTES) == 898_779
    # Half the GPU: 40 GiB stay free, 20 GiB of KV = 20 x 2^30 / 57344.
    assert kv_tokens_for(80 * GIB, 60 * GIB, 0.5, QWEN_7B_BYTES) == 374_491
    # Just one token's room.
    keep = int(80 * GIB * (1 - 0.85))
    assert kv_tokens_for(80 * GIB, keep + QWEN_7B_BYTES, 0.85, QWEN_7B_BYTES) == 1


def test_a_colocated_trainer_holding_the_gpu_is_an_error_naming_the_flag():
    """A trainer on the same GPU holds 70 GiB: 10 GiB free is less than the 12 GiB that
    --mem-fraction-static 0.85 keeps free; the engine refuses to start rather than OOM later
    while capturing its CUDA graphs."""
    with pytest.raises(MillstreamError) as err:
        kv_tokens_for(80 * GIB, 10 * GIB, 0.85, QWEN_7B_BYTES)
    message = str(err.value)
    assert "--mem-fraction-static 0.85" in message and "colocated trainer" in message
    assert "10.00 GiB" in message and "12.00 GiB" in message
    with pytest.raises(MillstreamError, match="--mem-fraction-static"):
        kv_tokens_for(80 * GIB, int(80 * GIB * 0.15) + QWEN_7B_BYTES - 1, 0.85, QWEN_7B_BYTES)


def test_the_gpu_budget_measures_free_memory_after_handing_back_cached_blocks(monkeypatch):
    """kv_token_budget's wiring, with the GPU's answers stood in: another process holds
    20 GiB and this one's weights 16 GiB of an 80 GiB GPU, so 44 GiB are free. At 0.9,
    8 GiB must stay free: 36 GiB of KV. (The old budget, the smaller of 0.9 x 80 - 16 and
    0.9 x 44, was 39.6 GiB, leaving 4.4 GiB for activations and graphs.)"""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def mem_get_info(device: torch.device) -> tuple[int, int]:
        calls.append("mem_get_info")
        return 44 * GIB, 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    tokens = kv_token_budget(QWEN_7B, torch.bfloat16, torch.device("cuda"), 0.9)
    assert calls == ["empty_cache", "mem_get_info"]
    assert tokens == (44 * GIB - int(80 * GIB * (1 - 0.9))) // QWEN_7B_BYTES
    assert 44 * GIB - tokens * QWEN_7B_BYTES >= 80 * GIB * (1 - 0.9)
