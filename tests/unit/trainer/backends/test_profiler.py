"""Miles' profiler flags: they parse, each one reaches the profiler, a real train step through
the torch backend writes one Chrome trace per target and profiled rollout (and none outside
the window), bad values exit 2 naming the flag, and --memory-snapshot-path is refused without
a CUDA GPU."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from millstream.common.config import ConfigError, build_parser, checks, parse_run_config
from millstream.common.config.profiling import PROFILE_TARGETS, ProfilingConfig
from millstream.common.errors import MillstreamError
from millstream.trainer import preflight
from millstream.trainer.backends.base import TrainSample
from millstream.trainer.backends.torch_backend import TorchBackend
from millstream.trainer.observe.profiler import TrainProfiler, event_name, trace_path

ARITH = Path(__file__).resolve().parents[4] / "examples" / "arith"
BASE = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]


def _cfg(*extra: str):
    return parse_run_config([*BASE, *extra])


def _samples() -> list[TrainSample]:
    return [
        TrainSample(tokens=[10, 11, 12, 13], prompt_len=2, loss_mask=[1, 1],
                    rollout_logprobs=[-1.0] * 2, reward=1.0),
        TrainSample(tokens=[20, 21, 22], prompt_len=1, loss_mask=[1, 1],
                    rollout_logprobs=[-1.0] * 2, reward=-1.0),
    ]  # fmt: skip


def _events(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def _spans(path: Path) -> set[str]:
    """The millstream.* ranges a trace holds."""
    return {
        e["name"]
        for e in _events(path)
        if e.get("ph") == "X" and e.get("name", "").startswith("millstream.")
    }


# -- flags ------------------------------------------------------------------------------------


def test_miles_defaults_and_spellings():
    p = _cfg().profiling
    assert (p.use_pytorch_profiler, p.profile_step_start, p.profile_step_end) == (False, 10, 12)
    assert (p.profile_target, p.memory_snapshot_path) == (["train_overall"], None)
    p = _cfg(
        "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "5",
        "--profile-target", "train_actor", "train_log_probs", "--memory-snapshot-path", "m.pickle",
    ).profiling  # fmt: skip
    assert (p.use_pytorch_profiler, p.profile_step_start, p.profile_step_end) == (True, 3, 5)
    assert (p.profile_target, p.memory_snapshot_path) == (
        ["train_actor", "train_log_probs"],
        os.path.abspath("m.pickle"),  # resolved against the working directory
    )


# What each flag changes in the profiler built from the config (a flag without a probe fails).
PROBES = {
    "use_pytorch_profiler": (["--use-pytorch-profiler"], lambda t: t.targets == {"train_overall"}),
    "profile_step_start": (["--profile-step-start", "7"], lambda t: t.start == 7),
    "profile_step_end": (["--profile-step-end", "9"], lambda t: t.end == 9),
    "profile_target": (["--profile-target", "train_actor"], lambda t: t.targets == {"train_actor"}),
    "memory_snapshot_path": (["--memory-snapshot-path", "m.pickle"], lambda t: t.memory_path),
}


def test_every_profiling_flag_reaches_the_profiler(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine's config
    group = next(
        g
        for g in build_parser("millstream train")._action_groups
        if g.title.startswith("profiling")
    )
    dests = {a.dest for a in group._group_actions}
    assert dests == {f.name for f in ProfilingConfig.__dataclass_fields__.values()}
    assert dests == set(PROBES)
    off = TrainProfiler.from_config(_cfg())
    assert not off.enabled
    on = ["--use-pytorch-profiler", "--profile-step-start", "1", "--run-dir", str(tmp_path)]
    for dest, (argv, probe) in PROBES.items():
        # Each flag's value, given alone beside the profiler, shows; without it, it does not.
        base = [] if dest == "use_pytorch_profiler" else on
        assert probe(TrainProfiler.from_config(_cfg(*base, *argv))), dest
        assert not probe(
            off if dest == "use_pytorch_profiler" else TrainProfiler.from_config(_cfg(*on))
        ), dest


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--use-pytorch-profiler", "--profile-step-start", "4", "--profile-step-end", "4"],
         "--profile-step-end (4) must be greater than --profile-step-start (4)"),
        (["--use-pytorch-profiler", "--profile-step-start", "13"], "--profile-step-end (12)"),
        (["--use-pytorch-profiler", "--profile-step-start", "-1"], "--profile-step-start"),
        (["--profile-target", "train_critic"], "--profile-target"),
        (["--use-pytorch-profiler", "--profile-target"], "--profile-target"),
        (["--memory-snapshot-path", " "], "--memory-snapshot-path is empty"),
    ],
)  # fmt: skip
def test_bad_profiler_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cfg(*argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err, err


def test_the_window_is_only_checked_when_something_is_profiled():
    """A Miles script may carry the window without the profiler: Miles ignores it."""
    assert _cfg("--profile-step-start", "20").profiling.profile_step_start == 20
    with pytest.raises(ConfigError, match="must be greater"):
        ProfilingConfig(use_pytorch_profiler=True, profile_step_start=20)


def _arith(*extra: str):
    return parse_run_config([
        "--hf-checkpoint", str(ARITH / "model"), "--prompt-data", str(ARITH / "data" / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact", "--num-rollout", "3",
        *BASE, *extra,
    ])  # fmt: skip


def test_preflight_refuses_a_window_the_run_never_reaches():
    with pytest.raises(ConfigError, match=r"^--profile-step-start 10: the run has --num-rollout 3"):
        checks.check(_arith("--use-pytorch-profiler"))
    checks.check(_arith("--use-pytorch-profiler", "--profile-step-start", "2"))
    checks.check(_arith())  # no profiler: the default window is not its business


# -- memory snapshot: CUDA only ---------------------------------------------------------------


def test_memory_snapshot_without_a_gpu_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # services elsewhere: this machine's other checks (redis-server, extras) stay out of it
    remote = ("--redis-url", "redis://r:6379/0", "--router-url", "http://router:30000")
    cfg = _arith(*remote, "--memory-snapshot-path", "snap.pickle", "--profile-step-start", "1")
    with pytest.raises(ConfigError, match=r"^--memory-snapshot-path needs a CUDA GPU"):
        preflight.check_machine(cfg)
    with pytest.raises(MillstreamError, match=r"^--memory-snapshot-path needs a CUDA GPU"):
        TrainProfiler.from_config(cfg)
    preflight.check_machine(_arith(*remote, "--profile-step-start", "1"))  # the flag alone
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    preflight.check_machine(cfg)  # a GPU machine takes it


def test_memory_history_spans_the_window_and_is_dumped_after_each_step(monkeypatch, tmp_path):
    """The calls into torch.cuda.memory, in order (this machine may have no GPU to record)."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history",
        lambda enabled="all", **kw: calls.append(("record", enabled, kw.get("max_entries"))),
    )  # fmt: skip
    monkeypatch.setattr(
        torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path))
    )
    path = tmp_path / "snaps" / "m.pickle"
    profiler = TrainProfiler(start=1, end=3, memory_snapshot_path=path, say=lambda line: None)
    for rollout_id in range(4):
        calls.append(("rollout", rollout_id))
        with (
            profiler.target("train_overall", rollout_id),
            profiler.target("train_actor", rollout_id),
        ):
            pass
    assert calls == [
        ("rollout", 0),
        ("rollout", 1), ("record", "all", 1_000_000), ("dump", str(path)),
        ("rollout", 2), ("dump", str(path)), ("record", None, None),
        ("rollout", 3),
    ]  # fmt: skip
    assert path.parent.is_dir()
    # A train step that raises (out of memory, say) dumps what was recorded, and stops.
    calls.clear()
    with pytest.raises(RuntimeError), profiler.target("train_overall", 1):
        raise RuntimeError("CUDA out of memory")
    assert calls == [("record", "all", 1_000_000), ("dump", str(path)), ("record", None, None)]


@pytest.mark.gpu
def test_a_real_cuda_memory_snapshot(tmp_path):
    path = tmp_path / "m.pickle"
    profiler = TrainProfiler(start=0, end=1, memory_snapshot_path=path, say=lambda line: None)
    with profiler.target("train_overall", 0):
        x = torch.ones(1024, 1024, device="cuda")
        del x
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["device_traces"] and any(snapshot["device_traces"])


# -- traces of a real train step --------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    """One actor for the module: the profiler is the backend's only part these tests change.
    One intra-op thread: a tiny model gains nothing from more, and on a busy machine their
    spinning costs seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=100)
    torch.set_num_threads(threads)


def test_a_profiled_train_step_writes_one_trace_per_target_inside_the_window(
    backend, tmp_path, capsys
):
    tb = tmp_path / "tb"
    cfg = _cfg(
        "--use-pytorch-profiler", "--profile-step-start", "1", "--profile-step-end", "2",
        "--profile-target", *PROFILE_TARGETS, "--tensorboard-dir", str(tb),
    )  # fmt: skip
    backend.profiler = TrainProfiler.from_config(cfg)
    for rollout_id in range(3):  # 0 before the window, 1 in it, 2 = end (exclusive)
        # two steps: the old policy's logprobs are computed before them (train_log_probs)
        backend.train_rollout(_samples(), 2, rollout_id)
    expected = {trace_path(tb, t, 1) for t in PROFILE_TARGETS}
    assert set(tb.iterdir()) == expected
    out = capsys.readouterr().out
    for target in PROFILE_TARGETS:
        path = trace_path(tb, target, 1)
        assert f"profile of {target}, rollout 1: {path}" in out
        spans = _spans(path)
        assert event_name(target) in spans
        ops = {e["name"] for e in _events(path) if e.get("cat") == "cpu_op"}
        assert "aten::addmm" in ops or "aten::mm" in ops or "aten::linear" in ops, sorted(ops)[:20]
    # The inner traces are cut from the whole step's: each holds its own range only.
    assert _spans(trace_path(tb, "train_overall", 1)) == {event_name(t) for t in PROFILE_TARGETS}
    assert _spans(trace_path(tb, "train_actor", 1)) == {"millstream.train_actor"}
    assert _spans(trace_path(tb, "train_log_probs", 1)) == {"millstream.train_log_probs"}
    actor_ops = {e["name"] for e in _events(trace_path(tb, "train_actor", 1))}
    assert any("backward" in name.lower() for name in actor_ops)
    assert not any(
        "backward" in e["name"].lower()
        for e in _events(trace_path(tb, "train_log_probs", 1))
        if e.get("ph") == "X"
    )


def test_an_inner_target_alone_is_its_own_session_under_the_run_dir(backend, tmp_path):
    cfg = _cfg(
        "--use-pytorch-profiler", "--profile-step-start", "0", "--profile-step-end", "1",
        "--profile-target", "train_actor", "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    backend.profiler = TrainProfiler.from_config(cfg)
    backend.train_rollout(_samples(), 1, 0)
    backend.train_rollout(_samples(), 1, 1)
    out = tmp_path / "run" / "profile"
    assert list(out.iterdir()) == [trace_path(out, "train_actor", 0)]
    assert _spans(trace_path(out, "train_actor", 0)) == {"millstream.train_actor"}


def test_a_failed_step_writes_no_trace_and_leaves_no_session_open(tmp_path):
    profiler = TrainProfiler(["train_overall"], 0, 2, tmp_path, say=lambda line: None)
    with pytest.raises(RuntimeError, match="boom"), profiler.target("train_overall", 0):
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with profiler.target("train_overall", 1):
        torch.ones(4) @ torch.ones(4)
    assert profiler.written == [trace_path(tmp_path, "train_overall", 1)]
    assert event_name("train_overall") in _spans(profiler.written[0])
