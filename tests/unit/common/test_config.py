"""Config: Miles' flags parse, the four-knob invariant, clear errors with exit status 2."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.common.config import ConfigError, parse_run_config
from millstream.common.config import store as config_store
from millstream.common.config.rollout import resolve_batch_knobs

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        # (rollout_batch_size, n_samples, global_batch_size, num_steps): one knob missing each
        ((None, 8, 64, 2), (16, 8, 64, 2)),
        ((16, None, 64, 2), (16, 8, 64, 2)),
        ((16, 8, None, 2), (16, 8, 64, 2)),
        ((16, 8, 64, None), (16, 8, 64, 2)),
        # fewer than three: n_samples and num_steps default to 1
        ((16, 8, None, None), (16, 8, 128, 1)),
        ((16, None, None, None), (16, 1, 16, 1)),
        ((None, 4, 32, None), (8, 4, 32, 1)),
        ((4, 8, 16, 2), (4, 8, 16, 2)),
    ],
)
def test_four_knobs_fill_the_missing_one(given, expected):
    assert resolve_batch_knobs(*given) == expected


def test_four_knobs_that_disagree_name_all_four_values():
    with pytest.raises(ConfigError) as err:
        resolve_batch_knobs(4, 8, 16, 3)
    msg = str(err.value)
    for part in (
        "--rollout-batch-size=4",
        "--n-samples-per-prompt=8",
        "--global-batch-size=16",
        "--num-steps-per-rollout=3",
    ):
        assert part in msg


@pytest.mark.parametrize(
    "given",
    [(5, 3, None, 2), (None, 3, 10, None), (7, None, 16, 1), (None, None, None, None)],
)
def test_four_knobs_impossible_fill_is_an_error(given):
    with pytest.raises(ConfigError):
        resolve_batch_knobs(*given)


def _run_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "millstream.cli", *args, "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_train_exits_2_on_knob_mismatch_with_a_clear_message(tmp_path):
    proc = _run_cli(
        "train", "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
        "--global-batch-size", "16", "--num-steps-per-rollout", "3", tmp_path=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--global-batch-size=16" in proc.stderr and "--num-steps-per-rollout=3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) <= 3, proc.stderr


def test_unknown_flag_exits_2_naming_it(tmp_path):
    proc = _run_cli(
        "train", "--rollout-batch-size", "4", "--rollout-batch-sise", "4", tmp_path=tmp_path
    )
    assert proc.returncode == 2
    assert "--rollout-batch-sise" in proc.stderr


def test_abbreviated_flag_is_not_accepted(tmp_path):
    proc = _run_cli("train", "--rollout-batch", "4", tmp_path=tmp_path)
    assert proc.returncode == 2


# The flags a train command needs, in the order its checks ask for them.
_BASE = ["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rm-type", "math"]
_ONE = [*_BASE, "--num-rollout", "1"]
_SAMPLES_1 = ["--n-samples-per-prompt", "1"]


@pytest.mark.parametrize(
    ("missing", "flags"),
    [
        ("--hf-checkpoint", []),
        ("--prompt-data", _BASE[:2]),
        ("--rm-type", _BASE[:4]),
        ("--num-rollout", _BASE),
        ("--critic-load", [*_ONE, "--advantage-estimator", "ppo", "--critic-load", "nowhere"]),
        (
            "--n-samples-per-prompt",
            [*_ONE, "--advantage-estimator", "reinforce_plus_plus_baseline", *_SAMPLES_1],
        ),
        ("--opd-teacher-url", [*_ONE, "--advantage-estimator", "on_policy_distillation"]),
    ],
)
def test_trainer_names_the_flag_it_needs(tmp_path, missing, flags):
    proc = _run_cli(
        "train",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "8",
        *flags,
        tmp_path=tmp_path,
    )
    assert proc.returncode == 2
    assert missing in proc.stderr and "Traceback" not in proc.stderr


def test_sync_mode_rejects_staleness_and_async_defaults_to_one():
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config(["--rollout-batch-size", "2", "--max-staleness", "2"], mode="sync")
    assert exit_info.value.code == 2
    cfg = parse_run_config(["--rollout-batch-size", "2"], mode="async")
    assert cfg.max_staleness == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--rollout-batch-size", "0"],
        ["--rollout-batch-size", "2", "--eval-prompt-data", "aime"],
        ["--rollout-batch-size", "2", "--rm-type", "remote_rm"],
        ["--rollout-batch-size", "2", "--kl-loss-coef", "0.1"],
        ["--rollout-batch-size", "2", "--tis-clip-low", "3"],
        ["--rollout-batch-size", "2", "--use-dynamic-batch-size"],
        ["--rollout-batch-size", "2", "--micro-batch-size", "4"],
        ["--rollout-batch-size", "2", "--rollout-temperature", "-1"],
        ["--rollout-batch-size", "2", "--kl-loss-type", "k9"],
        ["--rollout-batch-size", "2", "--kl-coef", "0.1"],
        ["--rollout-batch-size", "2", "--use-kl-in-reward"],  # grpo takes no reward-side KL
        ["--rollout-batch-size", "2", "--rollout-max-context-len", "1"],  # no room for a prompt
        ["--rollout-batch-size", "2", "--apply-chat-template-kwargs", "[1]"],
        ["--rollout-batch-size", "2", "--gamma", "1.5"],
        ["--rollout-batch-size", "2", "--value-clip", "0"],
        ["--rollout-batch-size", "2", "--use-opd"],
        [
            "--rollout-batch-size",
            "2",
            "--use-opd",
            "--opd-teacher-url",
            "http://t:1",
            "--opd-teacher-load",
            "m",
        ],
    ],
)
def test_bad_combinations_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_run_config(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_miles_tis_spellings_map_to_ours():
    cfg = parse_run_config(
        ["--rollout-batch-size", "2", "--use-tis", "--tis-clip", "3", "--custom-tis-function-path",
         "miles.backends.training_utils.loss_hub.corrections.icepop_function"]
    )  # fmt: skip
    assert (cfg.algo.tis_clip, cfg.algo.tis_mode) == (3.0, "icepop")
    assert parse_run_config(["--rollout-batch-size", "2"]).algo.tis_mode == "tis"


def test_config_is_frozen():
    cfg = parse_run_config(["--rollout-batch-size", "2"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.rollout_batch_size = 3  # type: ignore[misc]


def test_miles_launch_script_parses_unchanged():
    script = REPO / "examples" / "miles_compat" / "run-qwen3-4B.sh"
    out = subprocess.run(
        ["bash", str(script)], env={**os.environ, "MILLSTREAM_PRINT_ARGS": "1"},
        capture_output=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    argv = out.decode().split("\0")[:-1]
    cfg = parse_run_config(argv, mode="async", prog="millstream train-async")
    assert cfg.rollout.global_batch_size == 256 and cfg.rollout.num_steps_per_rollout == 1
    assert cfg.algo.eps_clip_high == 0.28 and cfg.algo.kl_loss_type == "low_var_kl"
    assert cfg.eval.datasets() == {"aime": "/root/aime-2024/aime-2024.jsonl"}
    assert cfg.megatron.tensor_model_parallel_size == 2 and cfg.megatron.qk_layernorm
    assert cfg.optimizer.adam_beta2 == 0.98 and cfg.perf.max_tokens_per_gpu == 9216


@pytest.mark.parametrize("mode", ["train", "train-async"])
def test_the_main_job_script_parses_in_both_modes(tmp_path, mode):
    recorder = tmp_path / "millstream"
    recorder.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    recorder.chmod(0o755)
    env = {
        **os.environ,
        "MILLSTREAM": str(recorder),
        "RUN_DIR": str(tmp_path / "run"),
        "MODE": mode,
    }
    out = subprocess.run(
        ["bash", str(REPO / "examples" / "arith" / "run.sh")], env=env,
        capture_output=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    command, *argv = out.decode().split("\0")[:-1]
    assert command == mode
    sync = mode == "train"
    cfg = parse_run_config(argv, mode="sync" if sync else "async", prog=f"millstream {mode}")
    assert cfg.max_staleness == (0 if sync else 1)
    assert cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt == 512


def test_json_round_trip_is_exact():
    cfg = parse_run_config(
        ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-stop", "</s>", "\n\n",
         "--eval-prompt-data", "a", "a.jsonl", "--rollout-stop-token-ids", "1", "2"],
        mode="async",
    )  # fmt: skip
    assert config_store.loads(config_store.dumps(cfg)) == cfg


def _file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_redis_password_file_resolves_into_the_password_once(tmp_path):
    from millstream.rollout.config import parse_worker_args

    file = _file(tmp_path, "pw", "s3cret\n\n")
    cfg = parse_run_config(["--rollout-batch-size", "1", "--redis-password-file", file])
    assert cfg.connection.redis_password == "s3cret"
    # A config resolved again (the launcher points it at its own Redis) stays the same.
    moved = dataclasses.replace(cfg.connection, redis_url="redis://127.0.0.1:1/0")
    assert moved.redis_password == "s3cret"
    same = ["--redis-password", "s3cret", "--redis-password-file", file]
    args = parse_worker_args(["--redis-url", "redis://h:1/0", "--run-id", "r", *same])
    assert args.redis_password == "s3cret"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--redis-password-file", "/nonexistent/pw"], "/nonexistent/pw: cannot read it"),
        (["--redis-password-file", "{empty}"], "the file is empty"),
        (["--redis-password-file", "{pw}", "--redis-password", "other"], "not both"),
    ],
)
@pytest.mark.parametrize("command", ["train", "rollout", "reward", "reward-celery"])
def test_a_bad_redis_password_file_exits_2_naming_the_flag(
    tmp_path, capsys, command, flags, expected
):
    from millstream.reward.config import parse_celery_args
    from millstream.reward.config import parse_worker_args as parse_reward_args
    from millstream.rollout.config import parse_worker_args as parse_rollout_args

    names = {"{empty}": _file(tmp_path, "empty", "\n"), "{pw}": _file(tmp_path, "pw", "s3cret")}
    argv = [names.get(f, f) for f in flags] + ["--redis-url", "redis://h:1/0", "--run-id", "r"]
    parse = {
        "train": lambda a: parse_run_config([*a, "--rollout-batch-size", "1"]),
        "rollout": parse_rollout_args,
        "reward": parse_reward_args,
        "reward-celery": parse_celery_args,
    }[command]
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--redis-password-file" in err and expected in err
    assert "s3cret" not in err and "other" not in err


def test_the_trainer_takes_the_admin_token_from_the_environment_unless_given():
    env = {"MILLSTREAM_ADMIN_TOKEN": "from-env"}
    base = ["--rollout-batch-size", "1"]
    assert parse_run_config(base, environ=env).service.admin_token == "from-env"
    given = parse_run_config([*base, "--admin-token", "flag"], environ=env)
    assert given.service.admin_token == "flag"
    assert parse_run_config(base, environ={}).service.admin_token is None
    with pytest.raises(SystemExit):
        parse_run_config([*base, "--admin-token", " "], environ={})
