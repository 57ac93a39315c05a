"""--colocate's trainer side on the CPU: the flags as Miles resolves them, what is refused, and
the offload of the trainer's state (backends/offload.py). The engine's side is in
tests/unit/test_kv_pool.py and tests/integration/test_engine_http.py; the whole job colocated
in tests/e2e/test_colocate.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from millstream.common.config import ConfigError, checks, parse_run_config
from millstream.trainer.backends.offload import TrainOffload
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.build import colocation
from tests.unit.test_bf16 import _cfg, _samples


def _run_cfg(*flags: str):
    return parse_run_config(
        ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rm-type", "math",
         "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", *flags]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "train", "rollout"),
    [
        (["--colocate"], True, True),
        (["--colocate", "--no-offload-train"], False, True),
        (["--colocate", "--offload-rollout", "--no-offload-rollout"], True, False),
        ([], None, None),
    ],
)
def test_colocate_turns_on_both_offloads_unless_given(flags, train, rollout):
    turns = colocation(_run_cfg(*flags), backend=SimpleNamespace(device="cpu"), sync=None)
    if train is None:
        assert turns is None
        return
    assert (turns.offload is not None) == train and turns.release_engines == rollout


@pytest.mark.parametrize(
    ("flags", "environ", "message"),
    [
        (["--offload-train"], {}, "--offload-train frees memory"),
        (["--offload"], {}, "--offload frees memory"),
        (["--colocate", "--router-url", "http://r:1"], {}, "with --router-url"),
        (["--colocate", "--train-backend", "fsdp"], {}, "--train-backend fsdp"),
        (["--colocate"], {"WORLD_SIZE": "2"}, "with 2 ranks"),
    ],
)
def test_colocation_is_refused_where_it_cannot_work(flags, environ, message):
    with pytest.raises(ConfigError, match=message):
        checks.check(_run_cfg(*flags), environ)


def test_colocate_and_the_memory_fraction_pass_the_checks():
    cfg = _run_cfg("--colocate", "--sglang-mem-fraction-static", "0.7")
    checks.check(cfg, {})
    with pytest.raises(SystemExit):
        _run_cfg("--sglang-mem-fraction-static", "1.2")
    # The fractions by placement: tests/unit/test_placement.py.


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_offload_moves_every_tensor_and_training_goes_on_as_without_it(tiny_model_dir, bf16):
    """On the CPU a move copies nothing, so the test makes it copy (`copies`): every
    parameter, master, gradient and optimizer state lands in fresh storage and back, holders
    keep their identity (the optimizer, the --bf16 hooks), tied weights stay tied, and the
    next step equals the step of a backend that was never offloaded."""
    extra = ("--bf16",) if bf16 else ()
    moved = TorchBackend(_cfg(*extra), tiny_model_dir, ref_dir=None, total_steps=3)
    plain = TorchBackend(_cfg(*extra), tiny_model_dir, ref_dir=None, total_steps=3)
    moved.train_rollout(_samples(), 1, 0)
    plain.train_rollout(_samples(), 1, 0)

    offload = TrainOffload(moved)
    offload.copies = True
    params = list(moved.model.parameters())
    before = {id(p): p.data_ptr() for p in params}
    state_bytes = sum(
        t.nbytes for s in moved.optimizer.state.values() for t in s.values() if t.dim() > 0
    )
    away = offload.to_host()
    assert not offload.resident and offload.to_host().nbytes == 0  # already there
    assert away.nbytes >= sum(p.nbytes for p in params) + state_bytes > 0
    assert all(p.data_ptr() != before[id(p)] for p in params)
    assert list(moved.model.parameters()) == params  # the same Parameter objects
    back = offload.to_device()
    assert offload.resident and back.nbytes == away.nbytes and offload.moves == 2
    emb = moved.model.get_input_embeddings().weight
    if moved.model.config.tie_word_embeddings:
        assert emb.data_ptr() == moved.model.get_output_embeddings().weight.data_ptr()

    m1, m2 = moved.train_rollout(_samples(), 1, 1), plain.train_rollout(_samples(), 1, 1)
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    for a, b in zip(moved.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_offload_on_the_cpu_keeps_the_books_and_copies_nothing(tiny_model_dir):
    backend = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=2)
    offload = TrainOffload(backend)
    ptrs = [p.data_ptr() for p in backend.model.parameters()]
    move = offload.to_host()
    assert move.nbytes == offload.nbytes() > 0 and not offload.resident
    assert [p.data_ptr() for p in backend.model.parameters()] == ptrs
