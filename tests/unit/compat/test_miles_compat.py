"""examples/miles_compat: Miles-style launch scripts, one per recipe shape, and Megatron
checkpoints where the torch backend wants Hugging Face dirs or its own checkpoints.

Every script's flags parse (the script runs with MILLSTREAM pointed at a recorder, as
test_config.py and test_flags_consumed.py read examples/arith/run.sh); the refused one exits 2
in-process naming its flag; the runnable ones pass preflight in-process; each of them runs for real for one iteration
in tests/e2e/test_miles_scripts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from millstream.common.config import ConfigError, parse_run_config, refusals
from millstream.launch import plan
from millstream.trainer import main, preflight
from millstream.trainer.checkpoints import megatron_ckpt
from tests.support.tiny_job import arith_flags
from tests.unit.repo.test_flags_consumed import _script_argv

REPO = Path(__file__).resolve().parents[3]
MILES = REPO / "examples" / "miles_compat"
ARITH_MODEL = REPO / "examples" / "arith" / "model"
# script -> (command, the flag preflight refuses it for, or None: it runs on CPU)
SCRIPTS = {
    "run-grpo.sh": ("train", None),
    "run-dapo.sh": ("train-async", None),
    "run-gspo.sh": ("train", None),
    "run-ppo.sh": ("train", None),
    "run-opd.sh": ("train", None),
    "run-fully-async.sh": ("train-async", None),
    "run-qwen3-4B.sh": ("train-async", "--tensor-model-parallel-size"),
    "run-gpu-node.sh": ("train", None),
}
# Scripts for a GPU node: no flag is refused, and preflight refuses the placement on a
# machine without the GPUs (the message's start); CPU_ONLY=1 runs them on the CPU.
GPU_NODE = {"run-gpu-node.sh": "--rollout-num-gpus 2: this machine shows no GPU"}
RUNNABLE = [n for n, (_, refused) in SCRIPTS.items() if refused is None and n not in GPU_NODE]


def test_the_table_covers_the_folder():
    assert sorted(SCRIPTS) == sorted(p.name for p in MILES.glob("*.sh"))
    readme = (MILES / "README.md").read_text(encoding="utf-8")
    for name in SCRIPTS:
        assert f"`{name}`" in readme, name


def _recorder(tmp_path: Path) -> Path:
    recorder = tmp_path / "millstream"
    recorder.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    recorder.chmod(0o755)
    return recorder


def _command_and_argv(name: str, tmp_path: Path) -> tuple[str, list[str]]:
    """What the script would run: its command and its arguments."""
    if name == "run-qwen3-4B.sh":  # Miles' own: it runs `millstream` from PATH
        return "train-async", _script_argv(MILES / name, {"MILLSTREAM_PRINT_ARGS": "1"})
    env = {"MILLSTREAM": str(_recorder(tmp_path)), "RUN_DIR": str(tmp_path / "run")}
    command, *argv = _script_argv(MILES / name, env)
    return command, argv


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_each_script_parses_and_asks_only_for_what_it_says(tmp_path, name):
    command, argv = _command_and_argv(name, tmp_path)
    expected_command, refused = SCRIPTS[name]
    assert command == expected_command
    mode = "sync" if command == "train" else "async"
    cfg = parse_run_config(argv, mode=mode, prog=f"millstream {command}")
    found = list(refusals.refused(cfg))
    assert (found[0] if found else None) == refused, found
    if refused is None:
        refusals.check_model(cfg)  # no MODEL_ARGS: nothing to disagree with the model


def test_the_recipes_are_what_their_names_say(tmp_path):
    cfgs = {}
    for name in RUNNABLE:
        command, argv = _command_and_argv(name, tmp_path)
        cfgs[name] = parse_run_config(argv, mode="sync" if command == "train" else "async")
    dapo = cfgs["run-dapo.sh"]
    assert dapo.rollout.partial_rollout and dapo.rollout.over_sampling_batch_size == 16
    assert dapo.rollout.dynamic_sampling_filter_path.endswith("check_reward_nonzero_std")
    assert dapo.algo.eps_clip_high == 0.28 and dapo.max_staleness == 1
    assert cfgs["run-gspo.sh"].algo.advantage_estimator == "gspo"
    assert cfgs["run-ppo.sh"].algo.uses_critic and cfgs["run-ppo.sh"].algo.critic_lr == 1e-3
    opd = cfgs["run-opd.sh"].algo
    assert opd.distills and opd.opd_teacher_load == str(ARITH_MODEL)
    assert cfgs["run-fully-async.sh"].max_staleness == 2
    assert cfgs["run-grpo.sh"].max_staleness == 0


class _Started(Exception):
    """Preflight passed: the run would start now."""


def _exit_status(monkeypatch, command: str, argv: list[str]) -> int | str:
    """`millstream COMMAND ARGV` in this process: its exit status, or "started" once
    preflight has passed (nothing is started)."""

    def started(*_):
        raise _Started

    for name in ("_apply_cpu_budget", "_run_trainer", "_run_data_parallel"):
        monkeypatch.setattr(main, name, started)
    run = main.train if command == "train" else main.train_async
    try:
        return run(argv)
    except _Started:
        return "started"
    except SystemExit as exit_info:  # argparse
        return int(exit_info.code or 0)


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_each_script_passes_preflight_or_exits_2_naming_the_flag(
    monkeypatch, capsys, tmp_path, name
):
    command, argv = _command_and_argv(name, tmp_path)
    status = _exit_status(monkeypatch, command, argv)
    refused = SCRIPTS[name][1]
    err = capsys.readouterr().err
    if name in GPU_NODE and not plan.visible_gpus():
        assert status == 2
        assert err.startswith(f"millstream {command}: error: {GPU_NODE[name]}"), err
    elif refused is None:
        assert status == "started", err
    else:
        assert status == 2
        assert err.startswith(f"millstream {command}: error: {refused} "), err


# -- Megatron checkpoints: named for what they are, with what to do ---------------------------


def _torch_dist(root: Path, tracker: str = "release", ranks: int = 2) -> Path:
    """The layout Megatron's torch_dist format leaves on disk (names only: detection is by
    layout). `release`: Miles' convert_hf_to_torch_dist.py; a number: a training save."""
    name = "release" if tracker == "release" else f"iter_{int(tracker):07d}"
    it = root / name
    it.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    (it / ".metadata").write_bytes(b"")
    (it / "common.pt").write_bytes(b"")
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    for rank in range(ranks):
        (it / f"__{rank}_0.distcp").write_bytes(b"")
    return root


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("converted", "a Megatron torch_dist checkpoint (latest_checkpointed_iteration.txt says "
         "release, release/ holds .metadata, metadata.json, common.pt, 2 *.distcp files)"),
        ("saved", "a Megatron torch_dist checkpoint (latest_checkpointed_iteration.txt says 20, "
         "iter_0000020/ holds .metadata, metadata.json, common.pt, 2 *.distcp files)"),
        ("iter_dir", "a Megatron torch_dist checkpoint (.metadata, metadata.json, common.pt, "
         "2 *.distcp files)"),
        ("no_tracker", "a Megatron torch_dist checkpoint (iter_0000020/ holds .metadata, "
         "metadata.json, common.pt, 2 *.distcp files)"),
        ("legacy", "a Megatron torch (legacy) checkpoint (latest_checkpointed_iteration.txt "
         "says 5, iter_0000005/ holds mp_rank_00/ and 1 more)"),
        ("hf", None),
        ("ours", None),
        ("missing", None),
    ],
)  # fmt: skip
def test_a_megatron_checkpoint_is_recognised_by_its_layout(tmp_path, layout, expected):
    root = tmp_path / "ckpt"
    if layout == "converted":
        _torch_dist(root)
    elif layout in ("saved", "no_tracker"):
        _torch_dist(root, "20")
        if layout == "no_tracker":
            (root / "latest_checkpointed_iteration.txt").unlink()
    elif layout == "iter_dir":
        root = _torch_dist(tmp_path / "x") / "release"
    elif layout == "legacy":
        for rank in ("mp_rank_00", "mp_rank_01"):
            (root / "iter_0000005" / rank).mkdir(parents=True)
            (root / "iter_0000005" / rank / "model_optim_rng.pt").write_bytes(b"")
        (root / "latest_checkpointed_iteration.txt").write_text("5")
    elif layout == "hf":
        root = ARITH_MODEL
    elif layout == "ours":  # checkpoint.py's layout
        (root / "iter_0000003" / "model").mkdir(parents=True)
        (root / "iter_0000003" / "trainer_state.json").write_text("{}")
        (root / "latest_checkpointed_iteration.txt").write_text("3")
    assert megatron_ckpt.describe(root) == expected


def test_our_own_checkpoint_still_loads(tmp_path):
    """--load of millstream's iter_N/ dirs passes preflight; what resumes from it is tested with
    the runs (tests/e2e, and the scripts' run above)."""
    root = tmp_path / "ckpt"
    (root / "iter_0000003" / "model").mkdir(parents=True)
    (root / "iter_0000003" / "trainer_state.json").write_text("{}")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    preflight.check_files(parse_run_config(arith_flags("--load", str(root))))


def test_a_torch_dist_ref_load_exits_2_naming_the_flag_the_format_and_the_fix(
    monkeypatch, capsys, tmp_path
):
    ref = _torch_dist(tmp_path / "Qwen3-4B_torch_dist")
    argv = arith_flags("--ref-load", str(ref), "--use-kl-loss")
    assert _exit_status(monkeypatch, "train", argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"millstream train: error: --ref-load {ref} is a Megatron torch_dist checkpoint "
        "(latest_checkpointed_iteration.txt says release, release/ holds .metadata"
    ), err
    assert "--hf-checkpoint is" not in err and "not a Hugging Face model dir" not in err
    assert (
        f"`millstream convert torch-dist-to-hf --input-dir {ref / 'release'} --output-dir "
        f"HF_DIR --origin-hf-dir {ARITH_MODEL}` and pass --ref-load HF_DIR"
    ) in err
    assert "or train with --train-backend megatron, which reads torch_dist checkpoints" in err


@pytest.mark.parametrize("flag", ["--ref-load", "--load"])
def test_the_megatron_backend_takes_a_torch_dist_ref_load_and_load(tmp_path, flag):
    """Miles' start: what its converter made (--ref-load) or its Megatron saved (--load);
    megatron/dist.py reads them (tests/integration/trainer/test_megatron_dist.py)."""
    path = _torch_dist(tmp_path / "ckpt", "release" if flag == "--ref-load" else "20")
    argv = arith_flags(flag, str(path), "--use-kl-loss")
    with pytest.raises(ConfigError, match=rf"^{flag} {path} is a Megatron torch_dist"):
        preflight.check_files(parse_run_config(argv))
    preflight.check_files(parse_run_config([*argv, "--train-backend", "megatron"]))


def test_a_torch_dist_ref_load_without_hf_checkpoint_is_named_not_hf_checkpoint(tmp_path):
    ref = _torch_dist(tmp_path / "ref")
    argv = [a for a in arith_flags("--ref-load", str(ref))]
    i = argv.index("--hf-checkpoint")
    del argv[i : i + 2]
    with pytest.raises(ConfigError, match=r"^--ref-load .* is a Megatron torch_dist checkpoint"):
        preflight.check(parse_run_config(argv))


def test_a_torch_dist_load_is_named_with_what_the_torch_backend_resumes(tmp_path):
    load = _torch_dist(tmp_path / "Qwen3-4B_miles", "20")
    with pytest.raises(ConfigError) as err:
        preflight.check_files(parse_run_config(arith_flags("--load", str(load))))
    message = str(err.value)
    assert message.startswith(f"--load {load} is a Megatron torch_dist checkpoint"), message
    assert "resumes only its own checkpoints" in message
    assert f"--input-dir {load / 'iter_0000020'}" in message


@pytest.mark.parametrize("flag", ["--opd-teacher-load", "--critic-load"])
def test_a_torch_dist_model_dir_is_named_for_the_flag_given(tmp_path, flag):
    path = _torch_dist(tmp_path / "teacher")
    extra = ["--use-opd"] if flag == "--opd-teacher-load" else ["--advantage-estimator", "ppo"]
    with pytest.raises(ConfigError, match=rf"^{flag} {path} is a Megatron torch_dist"):
        preflight.check_files(parse_run_config(arith_flags(*extra, flag, str(path))))


def test_the_miles_qwen3_script_would_next_stop_at_its_torch_dist_ref_load(tmp_path):
    """Past its refused flags and with its model there, run-qwen3-4B.sh's --ref-load (read, for
    its --use-kl-loss) is the Megatron dir Miles' converter made: named as one."""
    model = tmp_path / "Qwen3-4B"
    model.mkdir()
    (model / "config.json").write_text((ARITH_MODEL / "config.json").read_text())
    ref = _torch_dist(tmp_path / "Qwen3-4B_torch_dist")
    paths = {"/root/Qwen3-4B": str(model), "/root/Qwen3-4B_torch_dist": str(ref)}
    _, argv = _command_and_argv("run-qwen3-4B.sh", tmp_path)
    cfg = parse_run_config([paths.get(a, a) for a in argv], mode="async")
    with pytest.raises(ConfigError) as err:
        preflight.check_files(cfg)
    assert str(err.value).startswith(f"--ref-load {ref} is a Megatron torch_dist checkpoint")
    assert f"--origin-hf-dir {model}` and pass --ref-load HF_DIR" in str(err.value)
