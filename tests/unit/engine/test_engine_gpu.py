"""The engine's GPU mechanisms on a real GPU (`make gpu-check`; skipped where torch sees none):
the memory a release gives back, the KV budget of --mem-fraction-static, FP8 `_scaled_mm`,
and a weight bucket received on the GPU. CUDA graph decoding against eager decoding is in
tests/unit/engine/kv/test_token_pool.py. Each test prints what it measured, for the record."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from millstream.common.errors import MillstreamError
from millstream.engine.config import parse_engine_config
from millstream.engine.core import new_batch
from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.kv.sizing import kv_bytes_per_token, kv_token_budget
from millstream.engine.kv.token_pool import TokenPool
from millstream.engine.paged_batch import PagedBatch
from millstream.engine.quant import fp8
from millstream.engine.scheduler import Scheduler
from millstream.engine.weights import WeightLoader, receive_broadcast
from tests.support.tiny_model import build_tiny_model
from tests.unit.engine.kv.test_token_pool import send_back, weights_of
from tests.unit.engine.test_engine_scheduler import PROMPTS, Tracked
from tests.unit.engine.test_engine_weight_receive import SPECS, SourcePG, _values

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

MIB = 2**20


def _free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def test_release_gives_the_weights_and_the_kv_cache_back_to_the_gpu(tmp_path: Path):
    """A 70M-parameter model in bf16 (~140 MiB) and a 128 MiB pool: after a release the GPU's
    free memory grows by about both, after the resume it is back where it was, and after a
    full update the engine generates what it did before."""
    model_dir = build_tiny_model(
        tmp_path, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4
    )
    runner = ModelRunner(str(model_dir), dtype="bfloat16", device="cuda")
    loader = WeightLoader(runner.model)
    weights = [(n, t.cpu()) for n, t in weights_of(runner)]  # sent back below, from the host
    pool = TokenPool(runner.model.config, 16 * 1024, runner.dtype, runner.device)
    # No CUDA graphs: only the weights and the pool.
    batch = PagedBatch(runner.model, pool, max_rows=16, context_length=1024)
    sched = Scheduler(runner, batch)
    sched.start()
    try:
        params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}
        before = Tracked("before", PROMPTS[0], **params)
        sched.submit([before.seq])
        before.result()
        expected = runner.weight_bytes + pool.nbytes

        free_before = _free()
        freed = sched.release_memory(["weights", "kv_cache"]).result(30)
        free_released = _free()
        assert freed == {"kv_cache": expected - runner.weight_bytes, "weights": runner.weight_bytes}
        slack = 0.05 * expected + 32 * MIB  # allocator segments shared with small tensors
        gained = free_released - free_before
        print(f"\nreleased {expected / MIB:.1f} MiB: the GPU's free memory grew {gained / MIB:.1f}")
        assert abs(gained - expected) <= slack, (gained / MIB, expected / MIB)

        start = time.perf_counter()
        sched.resume_memory(["weights", "kv_cache"]).result(30)
        free_resumed = _free()
        print(f"resumed in {time.perf_counter() - start:.3f} s: free {free_resumed / MIB:.1f} MiB")
        assert abs(free_resumed - free_before) <= slack, (free_resumed / MIB, free_before / MIB)

        send_back(sched, loader, weights)
        after = Tracked("after", PROMPTS[0], **params)
        sched.submit([after.seq])
        assert after.result().output_ids == before.seq.output_ids
    finally:
        sched.stop()


def test_the_kv_budget_leaves_total_times_one_minus_fraction_free(tmp_path: Path):
    """--mem-fraction-static chosen so that 256 MiB are left for the KV cache: the pool
    takes them, total x (1 - F) is still free after it is allocated, the CUDA graphs of 64
    rows are captured inside that reserve, and a request decodes through them. A fraction
    that leaves nothing is the error that names the flag."""
    model_dir = build_tiny_model(
        tmp_path, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8
    )
    runner = ModelRunner(str(model_dir), dtype="bfloat16", device="cuda")
    config = runner.model.config
    free, total = _free(), torch.cuda.mem_get_info()[1]
    fraction = 1 - (free - 256 * MIB) / total
    keep_free = total * (1 - fraction)

    cfg = parse_engine_config(
        ["--model-path", str(model_dir), "--mem-fraction-static", repr(fraction),
         "--max-running-requests", "64"]
    )  # fmt: skip
    reserved_before = torch.cuda.memory_reserved()
    batch = new_batch(runner, cfg)  # --cuda-graph-max-bs: --max-running-requests, 64
    assert batch.graphs is not None
    tokens = 256 * MIB // kv_bytes_per_token(config, runner.dtype)  # 32768, shared by all rows
    assert abs(batch.pool.capacity - tokens) <= 64, (batch.pool.capacity, tokens)
    free_pool = _free()
    # Beyond the pool's bytes (the budget), the batch's own tables, and the caching
    # allocator's rounding of each large block up to 2 MiB: a pool tensor a layer for keys
    # and one for values (each 32 MiB and 16 KiB: nearly 2 MiB rounded, 16 MiB in all), the
    # batch's index table and row numbers.
    tables = batch.table_RL.nbytes + batch._rows_B.nbytes
    blocks = len(batch.pool.keys) + len(batch.pool.values) + 2
    beyond = torch.cuda.memory_reserved() - reserved_before - batch.pool.nbytes
    print(f"\nF = {fraction:.4f}: pool {batch.pool.nbytes / MIB:.1f} MiB (+{beyond / MIB:.1f} "
          f"MiB of tables and rounding), then {free_pool / MIB:.1f} MiB free; kept free: "
          f"{keep_free / MIB:.1f} MiB")  # fmt: skip
    assert 0 <= beyond <= tables + blocks * 2 * MIB, (beyond / MIB, tables / MIB, blocks)
    assert free_pool >= keep_free - beyond - MIB  # a MiB: the driver's own granularity

    start = time.perf_counter()
    batch.graphs.capture_all()
    captured_s = time.perf_counter() - start
    graphs = free_pool - _free()
    print(f"captured {batch.graphs.sizes} in {captured_s:.2f} s, {graphs / MIB:.1f} MiB")
    assert graphs < keep_free
    sched = Scheduler(runner, batch)
    sched.start()
    try:
        tracked = [Tracked(f"r{i}", p, max_new_tokens=8) for i, p in enumerate(PROMPTS * 4)]
        sched.submit([t.seq for t in tracked])
        assert all(len(t.result().output_ids) == 8 for t in tracked)
    finally:
        sched.stop()

    with pytest.raises(MillstreamError, match="--mem-fraction-static"):
        kv_token_budget(config, runner.dtype, runner.device, 1 - (_free() + 1024 * MIB) / total)


def test_fp8_scaled_mm_on_cuda_agrees_with_the_dequantized_linear():
    """The W8A8 block GEMM (engine/quant/fp8.py `scaled_mm`) on the GPU: within bf16 rounding of the same
    arithmetic in fp32, and within activation quantization (~2^-4 per element) of the W8A16
    dequant path."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(
            f"FP8 _scaled_mm needs compute capability >= 8.9 (Ada, Hopper); "
            f"{torch.cuda.get_device_name()} is {torch.cuda.get_device_capability()}"
        )
    assert fp8.choose_gemm("auto", torch.device("cuda")) == "scaled_mm"
    gen = torch.Generator().manual_seed(0)
    q, scale_inv = fp8.quantize(torch.randn(384, 512, generator=gen) * 0.05)
    bias = (torch.randn(384, generator=gen) * 0.1).bfloat16()
    layer = fp8.Fp8Linear(q, scale_inv, bias).cuda()
    x = torch.randn(7, 512, generator=gen).bfloat16().cuda()
    layer.gemm = "dequant"
    dequant = layer(x).float()
    layer.gemm = "scaled_mm"
    scaled = layer(x).float()

    x_q, scale_MG = fp8.quantize_activations(x, 128)
    x_deq = (x_q.float().view(7, -1, 128) * scale_MG[:, :, None]).view(7, -1)
    want = x_deq @ fp8.dequantize(layer.weight, layer.weight_scale_inv).t() + bias.float().cuda()
    assert ((scaled - want).abs().max() / want.abs().max()).item() < 1e-2
    relative = (torch.linalg.norm(scaled - dequant) / torch.linalg.norm(dequant)).item()
    print(f"\nscaled_mm vs dequant: {relative:.4f} relative")
    assert relative < 0.06


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened"])
def test_a_bucket_received_on_the_gpu_stays_there(flattened: bool):
    """What an nccl group does with a bucket (engine/weights.py): the tensors are made on the
    engine's GPU and come back there, holding the sender's values."""
    values = [v.cuda() for v in _values()]
    sent = [torch.cat([v.reshape(-1).view(torch.uint8) for v in values])] if flattened else values
    out = receive_broadcast(
        SourcePG(sent), SPECS, torch.device("cuda"), flattened, timedelta(seconds=5)
    )
    for (_, got), want in zip(out, values, strict=True):
        assert got.is_cuda and torch.equal(got, want)
