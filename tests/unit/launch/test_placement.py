"""GPU placement from Miles' flags (launch/plan.py `gpu_plan`), and how each engine is started
(launch/engines.py): SGLang's server with the --sglang-* flags handed on, or millstream's
engine with those it has. No GPU is needed: the plan is computed for any GPU count."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.common.config import parse_run_config
from millstream.common.config.errors import ConfigError
from millstream.common.errors import MillstreamError
from millstream.launch import engines, plan
from millstream.launch.plan import GpuPlan, gpu_plan

REPO = Path(__file__).resolve().parents[3]
STANDIN = REPO / "tests" / "support" / "sglang_standin"


def _cfg(*flags: str):
    return parse_run_config(
        ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rm-type", "math",
         "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         *flags]
    )  # fmt: skip


@pytest.mark.parametrize(
    ("gpus", "flags", "trainer", "engines", "shares"),
    [
        # one GPU: the engine shares it (turns with --colocate)
        (1, [], (0,), ((0,),), True),
        (1, ["--colocate"], (0,), ((0,),), True),
        # two: the engine gets its own unless colocated
        (2, [], (0,), ((1,),), False),
        (2, ["--colocate"], (0,), ((0,),), True),
        (2, ["--rollout-num-engines", "2"], (0,), ((0,), (1,)), True),
        # four: Miles' split, TP 2 engines
        (4, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"], (0, 1), ((2,), (3,)), False),
        (4, ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
             "--rollout-num-gpus-per-engine", "2"], (0, 1), ((2, 3),), False),
        (4, ["--actor-num-gpus-per-node", "4", "--colocate"], (0, 1, 2, 3),
         ((0,), (1,), (2,), (3,)), True),
        # eight: Miles' docs shape, and colocated TP 2
        (8, ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"], (0, 1, 2, 3),
         ((4,), (5,), (6,), (7,)), False),
        (8, ["--actor-num-gpus-per-node", "8", "--colocate", "--rollout-num-gpus-per-engine", "2"],
         tuple(range(8)), ((0, 1), (2, 3), (4, 5), (6, 7)), True),
        # no GPU, or none asked for the engines: the CPU
        (0, [], (), ((),), False),
        (2, ["--rollout-num-gpus", "0"], (0,), ((),), False),
    ],
)  # fmt: skip
def test_the_plan_for_1_2_4_and_8_gpus(gpus, flags, trainer, engines, shares):
    p = gpu_plan(_cfg(*flags), gpus)
    assert p.trainer == trainer and p.engines == engines and p.shares == shares
    assert p.colocated == ("--colocate" in flags and gpus > 0)
    for k, engine_gpus in enumerate(engines):
        expected = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, engine_gpus))} if engine_gpus else {}
        assert p.engine_env(k) == expected


def test_the_plan_says_what_goes_where():
    p = gpu_plan(_cfg("--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                      "--rollout-num-gpus-per-engine", "2"), 4)  # fmt: skip
    assert p.describe() == (
        "GPU plan on 4 GPU(s): trainer rank 0: GPU 0, rank 1: GPU 1; engine-0: GPU 2,3"
    )
    shared = gpu_plan(_cfg(), 1).describe()
    assert shared.endswith("(sharing the trainer's GPU: --colocate makes them take turns)")
    assert gpu_plan(_cfg(), 0).describe() == "GPU plan: no GPU here; trainer: CPU; engine-0: CPU"


@pytest.mark.parametrize(
    ("gpus", "flags", "message"),
    [
        (4, ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"],
         "the placement needs 8 GPUs (4 for the trainer's ranks then 4 for the engines); this "
         "machine shows 4"),
        (0, ["--rollout-num-gpus", "2"], "--rollout-num-gpus 2: this machine shows no GPU"),
        (4, ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
         "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2"),
        (8, ["--rollout-num-gpus", "4", "--rollout-num-engines", "3"],
         "--rollout-num-engines 3 and --rollout-num-gpus 4 / --rollout-num-gpus-per-engine 1 = 4"),
        (1, ["--rollout-num-engines", "2"], "the placement needs 3 GPUs"),
    ],
)  # fmt: skip
def test_a_plan_the_machine_cannot_hold_is_refused_saying_why(gpus, flags, message):
    with pytest.raises(MillstreamError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpu_plan(_cfg(*flags), gpus)


def test_the_memory_fraction_by_where_the_engines_are():
    assert gpu_plan(_cfg(), 2).engine_fraction(_cfg()) is None  # a GPU of its own: 0.85
    assert gpu_plan(_cfg(), 1).engine_fraction(_cfg()) == plan.SHARED_MEM_FRACTION
    colocated = _cfg("--colocate")
    assert gpu_plan(colocated, 1).engine_fraction(colocated) == plan.COLOCATED_MEM_FRACTION
    given = _cfg("--sglang-mem-fraction-static", "0.7")
    assert gpu_plan(given, 2).engine_fraction(given) == 0.7
    assert plan.engine_device_args(gpu_plan(given, 2), given, 0) == [
        "--device", "cuda", "--mem-fraction-static", "0.7"]  # fmt: skip
    assert plan.engine_device_args(gpu_plan(given, 0), given, 0) == ["--device", "cpu"]


def test_visible_gpus_reads_cuda_visible_devices_without_torch(monkeypatch):
    monkeypatch.setattr(plan, "_driver_gpus", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert plan.visible_gpus() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert plan.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert plan.visible_gpus() == 0


def test_visible_devices_keeps_the_ids_as_written(monkeypatch):
    monkeypatch.setattr(plan, "_driver_gpus", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert plan.visible_devices() == ("0", "1", "2", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 2, 3,")
    assert plan.visible_devices() == ("2", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5b6a7c8d-aaaa,MIG-1f2e3d4c-bbbb")
    assert plan.visible_devices() == ("GPU-5b6a7c8d-aaaa", "MIG-1f2e3d4c-bbbb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")  # more than the driver has
    assert plan.visible_devices() == ("0", "1", "2", "3")


@pytest.mark.parametrize(
    ("parent", "flags", "engine_ids"),
    [
        (None, [], ["1"]),  # nothing hidden: the index is the id
        ("2,3", ["--colocate"], ["2"]),  # the engine on the trainer's index 0: physical GPU 2
        ("2,3", [], ["3"]),
        ("GPU-aaaa,GPU-bbbb", [], ["GPU-bbbb"]),  # UUIDs (or MIG ids) as the parent gave them
        ("4,5,6,7", ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                     "--rollout-num-gpus-per-engine", "2"], ["6,7"]),
        ("3,1", ["--rollout-num-engines", "2"], ["3", "1"]),  # in the order the parent wrote
    ],
)  # fmt: skip
def test_a_child_is_told_its_gpus_by_the_parents_ids_not_by_index(
    monkeypatch, parent, flags, engine_ids
):
    """Under CUDA_VISIBLE_DEVICES=2,3 the launcher's GPU 0 is the machine's GPU 2: an engine
    given CUDA_VISIBLE_DEVICES=0 would land on GPU 0, someone else's."""
    monkeypatch.setattr(plan, "_driver_gpus", lambda: 8)
    if parent is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent)
    p = gpu_plan(_cfg(*flags), plan.visible_devices())
    got = [p.engine_env(k)["CUDA_VISIBLE_DEVICES"] for k in range(len(p.engines))]
    assert got == engine_ids


def test_the_plan_prints_the_ids_the_gpus_have_on_the_machine(monkeypatch, capsys):
    monkeypatch.setattr(plan, "_driver_gpus", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    p = gpu_plan(_cfg(), plan.visible_devices())
    assert p.describe() == (
        "GPU plan on 2 GPU(s) (CUDA_VISIBLE_DEVICES=2,3): trainer rank 0: GPU 2; engine-0: GPU 3"
    )
    flags = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rm-type", "math",
             "--num-rollout", "1", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2"]  # fmt: skip
    assert plan.main(flags) == 0
    assert capsys.readouterr().out.splitlines()[0] == p.describe()
    # --gpus N: a plan for some machine's N GPUs, numbered as they are there.
    assert plan.main(["--gpus", "2", *flags]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "GPU plan on 2 GPU(s): trainer rank 0: GPU 0; engine-0: GPU 1"
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_plan(_cfg(), plan.visible_devices()).describe() == (
        "GPU plan on 4 GPU(s): trainer rank 0: GPU 0; engine-0: GPU 1"
    )


# -- the engines' command lines -----------------------------------------------------------


SERVER = ["--sglang-mem-fraction-static", "0.7", "--sglang-context-length", "512",
          "--sglang-disable-cuda-graph", "--sglang-enable-dp-attention",
          "--sglang-chunked-prefill-size=4096", "--sglang-log-level", "warning"]  # fmt: skip


def test_sglang_flags_are_collected_in_order_with_their_values():
    cfg = _cfg(*SERVER, "--rollout-num-gpus-per-engine", "2")
    assert cfg.sglang.sglang_mem_fraction_static == 0.7  # one of ours: parsed, not collected
    assert cfg.sglang.sglang_server_args == SERVER[2:]
    assert engines.server_flags(cfg) == [
        ("--context-length", ["512"]), ("--disable-cuda-graph", []),
        ("--enable-dp-attention", []), ("--chunked-prefill-size", ["4096"]),
        ("--log-level", ["warning"]),
    ]  # fmt: skip


def test_sglang_gets_every_flag_as_miles_hands_them_on():
    cfg = _cfg(*SERVER, "--rollout-num-gpus-per-engine", "2", "--colocate")
    argv = engines.sglang_command(cfg, "/m", "127.0.0.1", 30001, "0", 0.7).argv
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[3:] == [
        "--model-path", "/m", "--host", "127.0.0.1", "--port", "30001", "--tp-size", "2",
        "--weight-version", "0", "--mem-fraction-static", "0.7", "--enable-memory-saver",
        "--context-length", "512", "--disable-cuda-graph", "--enable-dp-attention",
        "--chunked-prefill-size", "4096", "--log-level", "warning",
    ]  # fmt: skip
    engines.check(cfg, sglang=True)  # SGLang judges its own flags


def test_without_sglang_the_engine_takes_the_flags_it_has_and_refuses_the_rest_by_name():
    cfg = _cfg(*SERVER)
    with pytest.raises(ConfigError) as err:
        engines.check(cfg, sglang=False)
    assert str(err.value).startswith(
        "--sglang-enable-dp-attention, --sglang-chunked-prefill-size: SGLang is not installed"
    )
    ok = _cfg("--sglang-context-length", "512", "--sglang-disable-cuda-graph",
              "--sglang-random-seed", "7")  # fmt: skip
    engines.check(ok, sglang=False)
    assert engines.engine_flags(ok) == [
        "--context-length", "512", "--disable-cuda-graph", "--seed", "7"]  # fmt: skip
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine 2: SGLang is not"):
        engines.check(_cfg("--rollout-num-gpus-per-engine", "2"), sglang=False)


def test_the_engine_parses_every_flag_it_is_mapped_to(tiny_model_dir):
    """Each SGLANG_TO_ENGINE target is a flag of `millstream engine` (a typo here would only
    show when someone passes the --sglang-* flag)."""
    from millstream.engine.config import build_parser

    known = {a for action in build_parser()._actions for a in action.option_strings}
    assert set(engines.SGLANG_TO_ENGINE.values()) <= known


# -- `millstream plan` on the Miles-docs-shaped script ----------------------------------------


def _script_flags(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        ["bash", str(REPO / "examples" / "miles_compat" / "run-gpu-node.sh")],
        env={**os.environ, "MILLSTREAM": "echo", **env}, capture_output=True, text=True,
        check=True, timeout=30,
    ).stdout.split()  # fmt: skip
    assert out[0] == "train"
    return out[1:]


def _plan(flags: list[str], *, standin: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(STANDIN) if standin else ""}
    return subprocess.run(
        [sys.executable, "-m", "millstream.cli", "plan", "--gpus", "4", *flags],
        env=env, capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip


def test_the_gpu_node_script_prints_its_plan_with_sglang_and_is_refused_without():
    flags = _script_flags({})
    with_sglang = _plan(flags, standin=True)
    assert with_sglang.returncode == 0, with_sglang.stdout + with_sglang.stderr
    assert with_sglang.stdout.splitlines() == [
        "GPU plan on 4 GPU(s): trainer rank 0: GPU 0, rank 1: GPU 1; engine-0: GPU 2,3",
        "engines: 1 x SGLang (sglang.launch_server), --mem-fraction-static 0.7",
    ]
    without = _plan(flags, standin=False)
    assert without.returncode == 2
    assert "--rollout-num-gpus-per-engine 2: SGLang is not installed here" in without.stdout


def test_a_gpu_plan_on_a_machine_without_gpus_is_refused_by_preflight():
    from millstream.trainer import preflight

    cfg = _cfg("--rollout-num-gpus", "2")
    if plan.visible_gpus():
        pytest.skip("this machine has GPUs")
    with pytest.raises(ConfigError, match="--rollout-num-gpus 2: this machine shows no GPU"):
        preflight.check_placement(cfg)


def test_gpu_plan_is_a_frozen_record():
    with pytest.raises(AttributeError):
        GpuPlan(1, (0,), ((0,),)).gpus = 2  # type: ignore[misc]
