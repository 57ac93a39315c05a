"""The engine on a CUDA device simulated on the CPU (tests/support/sim_cuda/).

On the CPU every tensor is on one device, so a forgotten `.to(device)` passes every other
test and fails at the first step on a GPU. Here the engine runs with `--device cuda` on
simulated CUDA: its tensors say `cuda:0`, an op that mixes one with a host tensor fails as
on a GPU, and the decode step's CUDA graphs are captured (a read back to the host or a copy
from pageable memory inside the capture fails, as CUDA refuses it) and replayed. What a
simulation cannot show (memory, kernels, speed) stays in the GPU-marked tests.

The release and resume with a weight update run on it too: tests/unit/engine/kv/
test_token_pool.py's `own_runner` is on both devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from millstream.engine.executor.model_runner import ModelRunner
from millstream.engine.quant import fp8, fp8_gemm
from millstream.engine.scheduler import Scheduler
from tests.support.engine_scheduler import engine_scheduler
from tests.support.sim_cuda import CaptureError, DeviceMismatch, SimGraph, simulated_cuda
from tests.support.tiny_model import build_tiny_model
from tests.unit.engine.quant.test_fp8 import gemm_calls, make_fp8_copy
from tests.unit.engine.test_engine_scheduler import PROMPTS, Tracked, full_forward_logprobs

pytestmark = pytest.mark.timeout(180)


# -- the simulation refuses what CUDA refuses --------------------------------------------------


def test_the_simulated_device_refuses_what_cuda_refuses():
    with simulated_cuda():
        x = torch.zeros(4, device="cuda")
        assert x.is_cuda and x.device == torch.device("cuda", 0)
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        for mixed in (
            lambda: x + torch.ones(4),
            lambda: torch.cat([x, torch.ones(2)]),
            lambda: x.index_select(0, torch.tensor([0, 1])),
            lambda: torch.nn.functional.embedding(torch.tensor([1]), x.view(2, 2)),
        ):
            with pytest.raises(DeviceMismatch, match="cuda:0 and cpu"):
                mixed()
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        # What CUDA takes beside a device tensor: a host scalar, host indices, a copy.
        assert (x + torch.tensor(2.0)).tolist() == [2.0] * 4
        x[torch.tensor([0, 3])] = torch.tensor([5.0, 6.0], device="cuda")
        assert x[torch.tensor([3])].is_cuda and x.cpu().tolist() == [5.0, 0.0, 0.0, 6.0]
        x[1:3] = 1.0
        assert x[1:].tolist() == [1.0, 1.0, 6.0] and not x.cpu().is_cuda
        linear = torch.nn.Linear(4, 2).to("cuda", torch.bfloat16)
        assert linear.weight.is_cuda and linear.weight.dtype == torch.bfloat16
        # Autograd runs on it (native.cpp's device guard): device gradients, the host's values.
        host = torch.nn.Linear(4, 2)
        device = torch.nn.Linear(4, 2).to("cuda")
        device.load_state_dict(host.state_dict())
        inputs = torch.randn(3, 4)
        host(inputs).square().sum().backward()
        device(inputs.cuda()).square().sum().backward()
        assert device.weight.grad.is_cuda
        torch.testing.assert_close(device.weight.grad.cpu(), host.weight.grad)
        with pytest.raises(DeviceMismatch):
            device(inputs).sum().backward()
        # `.data =` (how the engine discards and reallocates its weights) holds what was set.
        linear.weight.data = torch.empty(0, device="cuda", dtype=torch.bfloat16)
        assert linear.weight.untyped_storage().nbytes() == 0
        linear.weight.data = torch.full((2, 4), 2.0, device="cuda", dtype=torch.bfloat16)
        assert (~(linear.weight.data == 2.0)).sum().item() == 0
    assert torch._C._accelerator_getAccelerator() is None  # torch as it was, outside


def test_a_graph_replays_its_ops_in_place_and_its_capture_refuses_a_host_sync():
    with simulated_cuda():
        a = torch.ones(3, device="cuda")
        pinned = torch.empty(3, pin_memory=True).fill_(2.0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b = a.new_empty(3)
            b.copy_(pinned.to("cuda", non_blocking=True))
            out = a * b + 1
            # A buffer made inside and accumulated into, and a cast: kernels a replay reruns.
            total = torch.zeros(3, device="cuda")
            total += a
            cast = (a * 2).to(torch.float64)
        assert isinstance(graph, SimGraph) and len(graph.ops) >= 3
        a.fill_(5.0)  # new inputs in the static tensors ...
        pinned.fill_(3.0)
        graph.replay()  # ... and the same output tensor holds the new result
        assert out.tolist() == [16.0] * 3
        graph.replay()
        assert total.tolist() == [5.0] * 3 and cast.tolist() == [10.0] * 3
        for inside in (
            lambda: a.sum().item(),
            lambda: a.tolist(),
            lambda: a.cpu(),
            lambda: torch.ones(3).to("cuda"),  # pageable host memory
            lambda: torch.tensor([1, 2], device="cuda"),
        ):
            with (
                pytest.raises(CaptureError, match="not permitted when stream is capturing"),
                torch.cuda.graph(torch.cuda.CUDAGraph()),
            ):
                inside()


# -- the engine on the device ----------------------------------------------------------------


@pytest.fixture(scope="module")
def device_runner(tiny_model_dir: Path) -> ModelRunner:
    """The tiny model on the simulated GPU, in float32 so that a full forward on the CPU is
    its reference to 1e-4 (the engine's default there is bfloat16)."""
    with simulated_cuda():
        return ModelRunner(str(tiny_model_dir), dtype="float32", device="cuda")


def _run(sched: Scheduler, *tracked: Tracked) -> None:
    sched.submit([t.seq for t in tracked])
    for t in tracked:
        t.result()


def test_every_kind_of_step_runs_on_the_device_and_agrees_with_a_full_forward(
    device_runner: ModelRunner, reference
):
    """A pool of 192 tokens (fixed, as on a GPU) with CUDA graphs: a fresh prompt alone (the
    plain causal prefill), then a burst of four lengths, two copies each, sampled with top-k
    and top-p (one packed prefill, shared prompt pages), then two rows that outgrow the pool
    (one retracted and prefilled again from the prefix cache). Every step decodes through
    a captured graph, and every logprob equals a full forward of the CPU's model."""
    with simulated_cuda():
        sched = engine_scheduler(device_runner, max_running_requests=8, max_total_tokens=192)
        pool = sched._batch.pool
        assert sched._batch.graphs is not None and pool.keys[0].is_cuda and not pool.can_grow
        sched.start()
        try:
            first = Tracked("first", PROMPTS[2], max_new_tokens=12, temperature=0)
            _run(sched, first)
            burst = [
                Tracked(f"p{i}-{j}", prompt, seed=10 * i + j, max_new_tokens=10, ignore_eos=True,
                        **({"top_k": 20, "top_p": 0.9} if j else {}))
                for i, prompt in enumerate(PROMPTS)
                for j in range(2)
            ]  # fmt: skip
            _run(sched, *burst)
            pair = [
                Tracked(f"r{i}", PROMPTS[0], max_new_tokens=150, temperature=0, ignore_eos=True)
                for i in range(2)
            ]
            _run(sched, *pair)
        finally:
            sched.stop()
        graphs = list(sched._batch.graphs._graphs.values())
    assert sched.stats.retracted >= 1 and sched._batch.cache.hits > 0
    assert graphs and all(isinstance(g, SimGraph) and g.replays > 0 for g, _, _ in graphs)
    assert pair[0].seq.output_ids == pair[1].seq.output_ids
    for t in (first, *burst, *pair):
        params = t.seq.params
        if params.top_k or params.top_p < 1:
            continue  # a truncated distribution: not a full forward's log-softmax
        expected = full_forward_logprobs(reference, t.seq)
        got = torch.tensor(t.seq.output_logprobs)
        assert torch.allclose(got, expected, atol=1e-4), (t.seq.rid, (got - expected).abs().max())


def test_an_fp8_model_takes_the_one_gemm_on_an_sm90_device(tmp_path: Path, monkeypatch):
    """On compute capability 9.0 the FP8 Linears whose dimensions are whole 128-blocks take
    the one block-scaled `scaled_mm` (fp8_gemm.py), probed on the device at load; the
    engine then serves a request through it, near the same model without FP8. The CPU has
    no block-scaled kernel: torch's checks judge the operands and an emulation computes
    (test_fp8.py's `gemm_calls`), on the device's tensors."""
    monkeypatch.setattr(fp8_gemm, "_blockwise_on", {})
    calls = gemm_calls(monkeypatch)
    model = build_tiny_model(tmp_path / "bf16", hidden_size=256, num_heads=4, num_kv_heads=2)
    fp8_dir = make_fp8_copy(tmp_path / "fp8", model)
    with simulated_cuda():
        runner = ModelRunner(str(fp8_dir), dtype="auto", device="cuda")
        plain = ModelRunner(str(model), dtype="auto", device="cuda")
        assert runner.dtype == torch.bfloat16 and runner.fp8_gemm == "scaled_mm"
        assert "scaled_mm" in {layer.gemm for layer in fp8.fp8_layers(runner.model).values()}
        outputs = []
        for r, eager in ((runner, False), (plain, False), (runner, True)):
            sched = engine_scheduler(
                r, max_running_requests=4, max_total_tokens=256, disable_cuda_graph=eager
            )
            sched.start()
            try:
                t = Tracked("fp8", PROMPTS[0], max_new_tokens=8, temperature=0, ignore_eos=True)
                _run(sched, t)
            finally:
                sched.stop()
            outputs.append(torch.tensor(t.seq.output_logprobs))
    assert "scaled_mm" in calls
    assert outputs[0].isfinite().all() and (outputs[0] - outputs[1]).abs().max() < 0.1
    assert torch.equal(outputs[0], outputs[2])  # its CUDA graphs replay what eager computes
