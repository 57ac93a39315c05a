"""The static KV cache (engine/kv_pool.py) on the CPU: what a GPU engine decodes with.

Every scheduler test also runs on the pool (test_engine_scheduler.py's `scheduler` fixture);
here are what only the pool has: compaction when its columns run out, the sizes captured in
CUDA graphs, how --kv-cache / --max-total-tokens size it, and releasing its memory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from millstream.common.errors import MillstreamError
from millstream.engine.config import parse_engine_config
from millstream.engine.core import running_batch
from millstream.engine.kv_batch import RunningBatch
from millstream.engine.kv_pool import KVPool, PoolBatch, graph_sizes
from millstream.engine.model_runner import ModelRunner
from millstream.engine.scheduler import RequestError, Scheduler
from millstream.engine.sequence import Sequence
from tests.unit.test_engine_scheduler import (
    PROMPTS,
    Tracked,
    full_forward_logprobs,
    pool_batch,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()


def test_graph_sizes_are_powers_of_two_then_every_eight():
    assert graph_sizes(1) == [1]
    assert graph_sizes(3) == [1, 2, 3]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_rows_that_outlast_the_pool_width_compact_it_and_keep_exact_logprobs(
    runner: ModelRunner, reference
):
    """A 48-column pool, rows joining at different steps: `end` passes 48 and the padding
    columns left of the longest live row are dropped (more than once), while every row's
    logprobs still equal a fresh full forward of its own prompt + output."""
    batch = pool_batch(runner, slots=4, width=48)
    shifts: list[int] = []
    shift = batch._shift
    batch._shift = lambda by: (shifts.append(by), shift(by))[1]  # type: ignore[method-assign]
    sched = Scheduler(runner, max_running_requests=4, batch=batch, context_length=48)
    sched.start()
    try:
        first = Tracked("a", PROMPTS[0], max_new_tokens=25, ignore_eos=True, temperature=0)
        sched.submit([first.seq])
        first.wait_tokens(15)
        second = Tracked("b", PROMPTS[1], seed=2, max_new_tokens=40, ignore_eos=True)
        sched.submit([second.seq])
        second.wait_tokens(20)
        third = Tracked("c", PROMPTS[3], seed=3, max_new_tokens=30, ignore_eos=True)
        sched.submit([third.seq])
        seqs = [t.result() for t in (first, second, third)]
    finally:
        sched.stop()
    assert sum(1 for by in shifts if by < 0) >= 1, shifts  # compacted
    for seq in seqs:
        assert len(seq.output_ids) == seq.params.max_new_tokens
        expected = full_forward_logprobs(reference, seq)
        got = torch.tensor(seq.output_logprobs)
        assert torch.allclose(got, expected, atol=1e-4), (seq.rid, (got - expected).abs().max())


def test_a_prefix_longer_than_the_live_columns_shifts_the_live_rows_right(
    runner: ModelRunner, reference
):
    batch = pool_batch(runner, slots=4, width=96)
    sched = Scheduler(runner, max_running_requests=4, batch=batch, context_length=96)
    sched.start()
    try:
        short = Tracked("short", PROMPTS[1], max_new_tokens=20, ignore_eos=True, temperature=0)
        sched.submit([short.seq])
        short.wait_tokens(3)
        width_before = batch.width
        long = Tracked("long", PROMPTS[2], max_new_tokens=5, ignore_eos=True, temperature=0)
        seqs = [long.seq, short.seq]
        sched.submit([long.seq])
        long.result(), short.result()
    finally:
        sched.stop()
    assert width_before < len(PROMPTS[2])
    for seq in seqs:
        expected = full_forward_logprobs(reference, seq)
        assert torch.allclose(torch.tensor(seq.output_logprobs), expected, atol=1e-4)


def _config(tiny_model_dir: Path, *flags: str):
    return parse_engine_config(["--model-path", str(tiny_model_dir), *flags])


def test_kv_cache_flag_and_max_total_tokens_size_the_pool(
    runner: ModelRunner, tiny_model_dir: Path
):
    batch, context = running_batch(_config(tiny_model_dir), runner)
    assert isinstance(batch, RunningBatch) and context is None  # auto on the CPU: dynamic

    cfg = _config(
        tiny_model_dir, "--kv-cache", "static", "--max-running-requests", "8",
        "--max-total-tokens", "512",
    )  # fmt: skip
    batch, context = running_batch(cfg, runner)
    assert isinstance(batch, PoolBatch)
    assert batch.pool.shape[0] == 8 and batch.pool.width == 64 and context == 64
    assert batch.graphs is None  # no CUDA graphs on the CPU

    too_small = _config(
        tiny_model_dir, "--kv-cache", "static", "--max-running-requests", "8",
        "--max-total-tokens", "64",
    )  # fmt: skip
    with pytest.raises(MillstreamError, match="8 tokens per request"):
        running_batch(too_small, runner)


def test_engine_flags_validate_the_gpu_settings(tiny_model_dir: Path):
    cfg = _config(tiny_model_dir, "--mem-fraction-static", "0.7", "--cuda-graph-max-bs", "32")
    assert cfg.mem_fraction_static == 0.7 and cfg.cuda_graph_max_bs == 32
    assert cfg.device == "auto" and cfg.dtype == "auto" and cfg.kv_cache == "auto"
    for flags in (
        ["--mem-fraction-static", "1.5"],
        ["--device", "tpu"],
        ["--cuda-graph-max-bs", "0"],
    ):
        with pytest.raises(SystemExit):
            _config(tiny_model_dir, *flags)


def test_device_cuda_without_a_gpu_is_an_error_that_says_so(tiny_model_dir: Path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(MillstreamError, match="--device cuda: torch sees no GPU"):
        ModelRunner(str(tiny_model_dir), device="cuda")


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_released_memory_holds_every_request_until_resumed(runner: ModelRunner, kind: str):
    batch = pool_batch(runner, slots=4, width=256) if kind == "static" else None
    sched = Scheduler(runner, max_running_requests=4, batch=batch, context_length=256)
    sched.start()
    try:
        params = {"max_new_tokens": 150, "ignore_eos": True, "temperature": 0}
        alone = Tracked("alone", PROMPTS[0], **params)
        sched.submit([alone.seq])
        alone.result()

        again = Tracked("again", PROMPTS[0], **params)
        sched.submit([again.seq])
        again.wait_tokens(5)
        with pytest.raises(RequestError, match="tags"):
            sched.release_memory(["gpu"]).result(10)
        freed = sched.release_memory(None).result(10)
        if kind == "static":
            assert freed["kv_cache"] == batch.pool.nbytes_allocated > 0
            assert not batch.pool.allocated
        assert sched.released == {"weights", "kv_cache", "cuda_graph"}
        assert sched.stats.retracted == 1 and sched.info()["num_waiting_reqs"] == 1
        newcomer = Tracked("new", PROMPTS[1], max_new_tokens=3)
        sched.submit([newcomer.seq])
        sched.resume().result(10)  # a /continue_generation is not a resume of memory
        steps = sched.stats.steps
        time.sleep(0.3)
        assert sched.stats.steps == steps and not again.done.is_set()
        sched.resume_memory(["weights"]).result(10)
        time.sleep(0.1)
        assert sched.stats.steps == steps  # the KV cache is still released
        allocated = sched.resume_memory(None).result(10)
        if kind == "static":
            assert allocated["kv_cache"] > 0 and batch.pool.allocated
        assert again.result().output_ids == alone.seq.output_ids
        assert len(newcomer.result().output_ids) == 3
        assert sched.released == set()
    finally:
        sched.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decoding_equals_eager_decoding_on_the_gpu(tiny_model_dir: Path):
    """On a GPU: the decode step replayed from CUDA graphs gives the tokens and logprobs of the
    same pool decoded eagerly, with rows joining and leaving (graph sizes 1..8), and a
    release/resume in the middle (the graphs are captured again)."""
    gpu = ModelRunner(str(tiny_model_dir), dtype="float32", device="cuda")

    def generate(graphs: int | None) -> list[Sequence]:
        pool = KVPool(gpu.model.config, 8, 128, gpu.dtype, gpu.device)
        batch = PoolBatch(gpu.model, pool, cuda_graph_max_bs=graphs)
        if batch.graphs is not None:
            batch.graphs.capture_all()
        sched = Scheduler(gpu, max_running_requests=8, batch=batch, context_length=128)
        sched.start()
        try:
            tracked = [
                Tracked(f"r{i}", p, max_new_tokens=20 + 5 * i, ignore_eos=True, temperature=0)
                for i, p in enumerate(PROMPTS)
            ]
            sched.submit([t.seq for t in tracked[:2]])
            tracked[0].wait_tokens(5)
            sched.release_memory(None).result(10)
            sched.resume_memory(None).result(10)
            sched.submit([t.seq for t in tracked[2:]])
            return [t.result() for t in tracked]
        finally:
            sched.stop()

    eager, graphed = generate(None), generate(8)
    for e, g in zip(eager, graphed, strict=True):
        assert g.output_ids == e.output_ids, g.rid
        torch.testing.assert_close(
            torch.tensor(g.output_logprobs), torch.tensor(e.output_logprobs), atol=1e-4, rtol=0
        )
