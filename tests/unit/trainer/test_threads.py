"""The CPU budget: how the launcher splits a machine's cores between trainer and engines."""

from __future__ import annotations

from typing import ClassVar

import pytest

from millstream.common import threads
from millstream.common.config import parse_run_config
from millstream.launch.plan import cpu_budget


@pytest.mark.parametrize(
    ("cores", "engines", "trainer", "expected"),
    [
        (2, 1, None, (1, 1)),  # this machine: one core each
        (16, 1, None, (8, 8)),
        (16, 2, None, (8, 4)),
        (3, 1, None, (2, 1)),  # the trainer rounds up
        (1, 1, None, (1, 1)),  # never zero threads, even when they must share
        (2, 4, None, (1, 1)),  # more engines than cores: engines share
        (8, 0, None, (8, 0)),  # no local engines: the trainer takes every core
        (8, 1, 2, (2, 6)),  # --num-threads fixes the trainer's share
    ],
)
def test_split_cores(cores, engines, trainer, expected):
    budget = threads.split_cores(cores, engines, trainer)
    assert (budget.trainer, budget.engine) == expected
    assert budget.trainer + budget.engine * engines <= max(cores, 1 + engines)


@pytest.mark.parametrize(
    ("cores", "engines", "expected"),
    [(2, 1, (2, 2)), (16, 2, (16, 8)), (8, 0, (8, 0)), (2, 4, (2, 1))],
)
def test_in_sync_mode_the_trainer_and_the_engines_each_take_every_core(cores, engines, expected):
    budget = threads.split_cores(cores, engines, overlap=False)
    assert (budget.trainer, budget.engine) == expected


def test_the_launcher_budget_follows_the_flags(monkeypatch):
    monkeypatch.setattr(threads, "machine_cores", lambda: 8)
    base = ["--rollout-batch-size", "4", "--rollout-num-engines", "2"]
    cfg = parse_run_config(base, mode="async", prog="millstream train-async")
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engine) == (4, 2)
    cfg = parse_run_config(base, mode="sync", prog="millstream train")
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engine) == (8, 4)
    cfg = parse_run_config(
        [*base, "--num-threads", "2", "--engine-num-threads", "3"], mode="sync", prog="t"
    )
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engine) == (2, 3)
    cfg = parse_run_config([*base, "--router-url", "http://r:1"], mode="sync", prog="t")
    assert (cpu_budget(cfg).trainer, cpu_budget(cfg).engines) == (8, 0)
    assert "trainer 8 thread(s)" in cpu_budget(cfg).describe()


def test_child_pools_are_capped_and_their_spin_bounded(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = threads.pool_env(1)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["GOMP_SPINCOUNT"] == threads.SPIN_COUNT
    # What the user chose stays: either variable sets the spin.
    for name, value in (("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "PASSIVE")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert "GOMP_SPINCOUNT" not in threads.pool_env(1) and threads.spin_env() == {}


def test_compute_runs_every_call_on_one_thread_with_the_callers_context():
    import asyncio
    import contextvars
    import threading

    current = contextvars.ContextVar("current", default="unset")

    def where(tag: str) -> tuple[int, str, str]:
        return threading.get_ident(), tag, current.get()

    def fail() -> None:
        raise ValueError("inside")

    async def calls(loop_tag: str) -> list[tuple[int, str, str]]:
        current.set(loop_tag)
        out = await asyncio.gather(*(threads.compute(where, f"{loop_tag}{k}") for k in range(4)))
        with pytest.raises(ValueError, match="inside"):
            await threads.compute(fail)
        return out

    # Two event loops one after the other (the trainer's, a test's): still the one thread.
    seen = asyncio.run(calls("a")) + asyncio.run(calls("b"))
    assert len({ident for ident, _, _ in seen}) == 1
    assert seen[0][0] != threading.get_ident()
    assert [(tag, ctx) for _, tag, ctx in seen] == [(f"{t}{k}", t) for t in "ab" for k in range(4)]


def test_borrowed_cores_follow_the_engines_idleness_layer_by_layer():
    """Before each layer's forward the computing thread's pool is set: every core while the
    engines are idle, the trainer's share once they have work again (in that thread)."""
    import threading

    import torch

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    layers = model.layers
    idle_at = {1, 2}  # the engines are idle while layers 1 and 2 run
    seen: list[int] = []
    calls = iter(range(100))
    lender = threads.BorrowedCores(1, 2, idle=lambda: next(calls) % 4 in idle_at)
    handles = lender.hook_layers(model)
    for layer in layers:
        layer.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))

    def train_step() -> None:
        torch.set_num_threads(1)
        model(torch.ones(1, 4)).sum().backward()
        seen.append(torch.get_num_threads())  # after the backward's retunes

    worker = threading.Thread(target=train_step)
    worker.start()
    worker.join()
    # Forward: calls 0-3; backward, layer 3 down to 0: calls 4-7 (idle at 5 and 6), and the
    # backward leaves the pool as the last layer's gradient found it.
    assert seen == [1, 2, 2, 1, 1] and lender.switches == 4
    for handle in handles:
        handle.remove()


def test_only_an_async_trainer_beside_its_own_engines_borrows_cores():
    import torch

    from millstream.trainer.build import lend_idle_cores

    class Backend:
        model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
        critic = None

    class Admission:
        in_flight: ClassVar[dict] = {"g1": (0, 1)}

    class Buffer:
        ready = 1

    def lender(budget, mode="async", *flags):
        cfg = parse_run_config(["--rollout-batch-size", "1", *flags], mode=mode)
        return lend_idle_cores(cfg, budget, Backend(), Admission(), Buffer())

    split = threads.split_cores(2, 1)
    lent = lender(split)
    assert (lent.own, lent.most) == (1, 2) and lent.idle()  # every admitted group is back
    Admission.in_flight = {"g1": (0, 1), "g2": (0, 2)}
    assert not lent.idle()  # one still generating
    assert lender(threads.split_cores(2, 1, overlap=False), "sync") is None
    assert lender(split, "async", "--num-threads", "1") is None  # the user's number stands
    assert lender(threads.split_cores(2, 0)) is None  # engines elsewhere: every core already
    assert lender(None) is None  # no local launcher
