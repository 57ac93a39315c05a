"""--colocate's trainer side on the CPU: the flags as Miles resolves them, what is refused, and
the offload of the trainer's state (backends/offload.py): its books against the backend's own
tensors, and round trips that copy (gradients dropped, host buffers kept) leaving training as
without them. The turns' order: tests/unit/trainer/test_colocate_turns.py; measured on a GPU:
tests/unit/trainer/backends/test_colocate_gpu.py and tests/integration/test_colocate_engine.py. The engine's
side is in tests/unit/engine/kv/test_token_pool.py and tests/integration/test_engine_http.py; the whole job
colocated in tests/e2e/test_colocate.py."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from millstream.common.config import ConfigError, checks, parse_run_config
from millstream.trainer.backends.offload import TrainOffload
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.build import colocation
from tests.unit.trainer.backends.test_bf16 import _cfg, _samples


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
    # The fractions by placement: tests/unit/launch/test_placement.py.


# -- the trainer's offload (backends/offload.py) ----------------------------------------------


def _backend(tiny_model_dir, *flags: str, ref: bool = False) -> TorchBackend:
    critic = tiny_model_dir if "ppo" in flags else None
    return TorchBackend(
        _cfg(*flags), tiny_model_dir, ref_dir=tiny_model_dir if ref else None,
        critic_dir=critic, total_steps=4,
    )  # fmt: skip


def _models(b: TorchBackend) -> list[torch.nn.Module]:
    return [m for m in (b.model, b.ref, b.teacher, b.critic) if m is not None]


def _grads_held(b: TorchBackend) -> list[torch.Tensor]:
    masters = b.master.params if b.master is not None else []
    params = [p for m in _models(b) for p in m.parameters()] + list(masters)
    return [p.grad for p in params if p.grad is not None]


def _held(b: TorchBackend) -> tuple[int, int]:
    """(the bytes an offload must carry, the gradient bytes), counted from the backend's own
    attributes: every model's parameters and buffers, the --bf16 masters, every optimizer's
    state tensors but its scalar step counters; a storage reached twice counted once."""
    carried: dict[int, int] = {}
    for model in _models(b):
        for t in itertools.chain(model.parameters(), model.buffers()):
            carried[t.data_ptr()] = t.nbytes
    for p in b.master.params if b.master is not None else []:
        carried[p.data_ptr()] = p.nbytes
    for optimizer in (b.optimizer, getattr(b, "critic_optimizer", None)):
        for state in optimizer.state.values() if optimizer is not None else []:
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    carried[t.data_ptr()] = t.nbytes
    return sum(carried.values()), sum(g.nbytes for g in _grads_held(b))


@pytest.mark.parametrize("flags", [(), ("--bf16",)], ids=["fp32", "bf16"])
def test_the_offloads_books_are_what_the_backend_holds(tiny_model_dir, flags):
    """The bytes an offload claims to move are the backend's tensors, counted independently
    (actor, reference and critic, the masters, Adam's moments), gradients apart: those are
    dropped, and said so. On the CPU nothing is copied, but the books are a GPU's."""
    b = _backend(tiny_model_dir, *flags, "--advantage-estimator", "ppo", ref=True)
    assert b.ref is not None and b.critic is not None and (b.master is not None) == bool(flags)
    b.train_rollout(_samples(), 1, 0)
    carried, grads = _held(b)
    assert grads > 0 and carried > sum(p.nbytes for p in b.model.parameters()) + grads

    offload = TrainOffload(b)
    assert not offload.copies and offload.resident_bytes() == carried + grads
    away = offload.to_host()
    assert (away.nbytes, away.dropped) == (carried, grads)
    assert _held(b) == (carried, 0) and offload.resident_bytes() == 0
    back = offload.to_device()
    assert (back.nbytes, back.dropped) == (carried, 0) and offload.resident_bytes() == carried

    offload.copies = True  # the copying path keeps the same books
    assert offload.to_host().nbytes == carried and offload.to_device().nbytes == carried
    assert _held(b) == (carried, 0)


@pytest.mark.parametrize(
    "flags",
    [(), ("--bf16",), ("--bf16", "--advantage-estimator", "ppo")],
    ids=["fp32", "bf16", "bf16-ppo"],
)
def test_offload_round_trips_leave_training_as_without_them(tiny_model_dir, flags):
    """On the CPU a move copies nothing, so the test makes it copy (`copies`): every
    parameter, master and optimizer state lands in fresh storage and back, holders keep their
    identity (the optimizer, the --bf16 hooks), tied weights stay tied. The gradients are
    dropped, not moved, and every step after a round trip equals the step of a backend never
    offloaded (the next backward makes them again: fp32 on the parameters, --bf16 on the
    masters, PPO's on the critic). Each tensor's host buffer is allocated once and reused by
    every later offload, and the way back never hands a holder a host buffer."""
    moved, plain = _backend(tiny_model_dir, *flags), _backend(tiny_model_dir, *flags)
    offload = TrainOffload(moved)
    offload.copies = True
    params = list(moved.model.parameters())
    first_host: dict[int, int] = {}
    for it in range(2):  # the first offload allocates its buffers, the second reuses them
        m1, m2 = moved.train_rollout(_samples(), 1, it), plain.train_rollout(_samples(), 1, it)
        assert m1.keys() == m2.keys()
        for name in m1:
            assert m1[name] == pytest.approx(m2[name], rel=1e-5, abs=1e-6), (it, name)
        for a, b in zip(moved.model.parameters(), plain.model.parameters(), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

        grads = sum(g.nbytes for g in _grads_held(moved))
        on_device = {id(p): p.data_ptr() for p in params}
        allocations = offload.host_allocations
        away = offload.to_host()
        assert not offload.resident and offload.to_host().nbytes == 0  # already there
        assert away.dropped == grads > 0 and not _grads_held(moved)
        assert away.nbytes == _held(moved)[0]
        host = {id(p): p.data_ptr() for p in params}
        assert all(host[i] != on_device[i] for i in host)
        if it == 0:
            first_host = host
        else:  # the same buffers: nothing allocated again
            assert host == first_host and offload.host_allocations == allocations
        assert list(moved.model.parameters()) == params  # the same Parameter objects

        back = offload.to_device()
        assert offload.resident and back.nbytes == away.nbytes and offload.moves == 2 * (it + 1)
        assert not set(host.values()) & {p.data_ptr() for p in params}  # no alias of a buffer
        emb = moved.model.get_input_embeddings().weight
        if moved.model.config.tie_word_embeddings:
            assert emb.data_ptr() == moved.model.get_output_embeddings().weight.data_ptr()


def test_offload_on_the_cpu_keeps_the_books_and_copies_nothing(tiny_model_dir):
    backend = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=2)
    offload = TrainOffload(backend)
    ptrs = [p.data_ptr() for p in backend.model.parameters()]
    move = offload.to_host()
    assert move.nbytes == offload.nbytes() > 0 and not offload.resident
    assert [p.data_ptr() for p in backend.model.parameters()] == ptrs
    assert offload.host_allocations == 0
