"""Preflight: every config check that needs no service runs before anything starts.

Each bad flag is run through the real CLI (`python -m millstream.cli train ...`): exit 2, the
flag named in `prog: error: --flag ...`, and no `logs/` or `redis/` under --run-dir (what the
launcher creates first). The finer rules are checked in-process on a parsed RunConfig.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from millstream.common.config import ConfigError, checks, parse_run_config
from millstream.trainer import preflight
from tests.support.tiny_job import arith_flags

REPO = Path(__file__).resolve().parents[3]
ARITH = REPO / "examples" / "arith"

# A user's plugin module, written next to the run (the workers import it from their cwd).
PLUGIN = """
async def reward(args, sample):
    return 1.0


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    raise AssertionError("never called")


async def per_group(group, cfg, client):
    raise AssertionError("never called")


def old_reward(sample, cfg):
    return 1.0

NOT_A_FUNCTION = 3
"""


def _with(flags: list[str], flag: str, value: str) -> list[str]:
    """`flags` with `flag`'s value replaced (or the pair appended)."""
    out = list(flags)
    if flag in out:
        out[out.index(flag) + 1] = value
        return out
    return [*out, flag, value]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working directory with a plugin module, data files and a checkpoint dir to break."""
    (tmp_path / "my_plugins.py").write_text(PLUGIN)
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad_first.jsonl").write_text('not json\n{"prompt": "1+1=", "label": "2"}\n')
    (tmp_path / "all_bad.jsonl").write_text('\n["a list"]\n{"question": "no prompt key"}\n')
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "not_a_model").mkdir()
    bad_latest = tmp_path / "ckpt_bad_latest"
    bad_latest.mkdir()
    (bad_latest / preflight.LATEST).write_text("last\n")
    dangling = tmp_path / "ckpt_dangling"
    dangling.mkdir()
    (dangling / preflight.LATEST).write_text("5\n")
    return tmp_path


def _cli(work: Path, argv: list[str], env: dict[str, str] | None = None):
    run_dir = work / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "train", *argv, "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=60, cwd=work, env=env,
    )  # fmt: skip
    return proc, run_dir


def _assert_refused(proc, run_dir: Path, flag: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"millstream train: error: {flag}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "logs").exists() and not (run_dir / "redis").exists()


BAD = [
    # (flag named first, flags to change: [(flag, value), ...], more text the message has)
    ("--rm-type", [("--rm-type", "exactt")], "math, deepscaler, dapo, f1, exact, remote_rm"),
    ("--group-rm", [("--group-rm", "")], "--custom-rm-path"),
    ("--custom-rm-path", [("--custom-rm-path", "no_such_module.fn")], "cannot import"),
    ("--custom-rm-path", [("--custom-rm-path", "my_plugins.nope")], "has no 'nope'"),
    ("--custom-rm-path", [("--custom-rm-path", "my_plugins:NOT_A_FUNCTION")], "not a function"),
    ("--custom-rm-path", [("--custom-rm-path", "raises_on_import.fn")], "boom at import"),
    ("--rollout-function-path", [("--rollout-function-path", "my_plugins.generate")], "has no"),
    ("--buffer-filter-path", [("--buffer-filter-path", "no_such_module.fifo")], "cannot import"),
    ("--dynamic-sampling-filter-path", [("--dynamic-sampling-filter-path", "check_typo")], ""),
    ("--custom-generate-function-path", [("--custom-generate-function-path", "m.f")], "import"),
    (
        "--recompute-granularity",
        [("--train-backend", "megatron"), ("--recompute-granularity", "full")],
        "needs --recompute-method",
    ),
    (
        "--tensor-model-parallel-size",
        [("--train-backend", "megatron"), ("--tensor-model-parallel-size", "2")],
        "must divide the trainer's 1 rank(s)",
    ),
    ("--hf-checkpoint", [("--hf-checkpoint", "nowhere")], "does not exist"),
    ("--hf-checkpoint", [("--hf-checkpoint", "not_a_model")], "no config.json"),
    ("--ref-load", [("--ref-load", "not_a_model"), ("--use-kl-loss", "")], "config.json"),
    ("--critic-load", [("--critic-load", "nowhere"), ("--advantage-estimator", "ppo")], ""),
    ("--load", [("--load", "a_file")], "not a checkpoint directory"),
    ("--load", [("--load", "ckpt_bad_latest")], "not an iteration number"),
    ("--load", [("--load", "ckpt_dangling")], "iteration 5"),
    ("--save", [("--save", "a_file")], "not a directory"),
    ("--prompt-data", [("--prompt-data", "missing.jsonl")], "no such file"),
    ("--prompt-data", [("--prompt-data", "empty.jsonl")], "no rows"),
    ("--prompt-data", [("--prompt-data", "bad_first.jsonl")], "bad_first.jsonl:1:"),
    (
        "--prompt-data",
        [("--prompt-data", "all_bad.jsonl"), ("--skip-bad-lines", "")],
        "the first bad line is 2",
    ),
    ("--prompt-data", [("--input-key", "question")], "missing --input-key 'question'"),
    ("--eval-prompt-data dev", [("--eval-prompt-data", "dev missing.jsonl")], "no such file"),
]


def _argv(changes: list[tuple[str, str]]) -> list[str]:
    argv = arith_flags()
    for flag, value in changes:
        if not value:
            argv.append(flag)
        elif flag == "--eval-prompt-data":
            argv += [flag, *value.split()]
        else:
            argv = _with(argv, flag, value)
    return argv


@pytest.mark.parametrize(
    ("flag", "changes", "text"), BAD, ids=[f"{b[0]}-{b[1][0][1]}" for b in BAD]
)
def test_a_bad_flag_exits_2_naming_it_before_anything_starts(work, flag, changes, text):
    proc, run_dir = _cli(work, _argv(changes))
    _assert_refused(proc, run_dir, flag)
    assert text in proc.stderr


def test_no_redis_server_on_path_names_redis_url(work):
    empty = work / "bin"
    empty.mkdir()
    proc, run_dir = _cli(work, arith_flags(), env={**os.environ, "PATH": str(empty)})
    _assert_refused(proc, run_dir, "--redis-url")
    assert "redis-server is not on PATH" in proc.stderr


@pytest.mark.parametrize(
    ("flag", "package"), [("--use-wandb", "wandb"), ("--tensorboard-dir", "tensorboard")]
)
def test_missing_tracking_package_names_the_flag_and_the_install(work, flag, package):
    """`make test` installs the track extra, so the package is hidden from the CLI's process
    (a None in sys.modules: find_spec says it is not there, and an import fails)."""
    argv = (
        [*arith_flags(), flag]
        if flag == "--use-wandb"
        else [*arith_flags(), flag, str(work / "tb")]
    )
    run_dir = work / "run"
    hidden = (
        f"import sys; sys.modules[{package!r}] = None; sys.argv[0] = 'millstream'; "
        "from millstream.cli import run; run()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", hidden, "train", *argv, "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=60, cwd=work,
    )  # fmt: skip
    _assert_refused(proc, run_dir, flag)
    assert f"pip install {package}" in proc.stderr


# -- in-process: the rules behind the messages ------------------------------------------------


def _cfg(*argv: str):
    return parse_run_config(list(argv), mode="sync", prog="millstream train")


def test_the_arith_example_passes_without_importing_torch():
    code = (
        "import sys\n"
        "from millstream.common.config import parse_run_config\n"
        "from millstream.trainer import preflight\n"
        f"preflight.check(parse_run_config({arith_flags('--eval-prompt-data', 'arith', str(ARITH / 'data' / 'eval.jsonl'))!r}))\n"
        "assert 'torch' not in sys.modules, 'preflight imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_what_a_run_may_start_from(work, monkeypatch):
    monkeypatch.chdir(work)
    # a --load dir that is not there yet, or has no latest file: a fresh start
    preflight.check(_cfg(*arith_flags("--load", str(work / "new"), "--save", str(work / "new"))))
    preflight.check(_cfg(*arith_flags("--load", str(work / "not_a_model"))))
    ckpt = work / "ckpt"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "iter_0000003" / preflight.STATE).write_text("{}")
    (ckpt / preflight.LATEST).write_text("3\n")
    preflight.check(_cfg(*arith_flags("--load", str(ckpt))))
    # --ref-load that no KL term reads (a Miles script's Megatron dir) is not checked
    preflight.check(_cfg(*arith_flags("--ref-load", str(work / "not_a_model"))))
    # bad lines before a good one, skipped; built-in filter names and `module:fn` paths
    argv = _with(arith_flags(), "--prompt-data", str(work / "bad_first.jsonl"))
    preflight.check(_cfg(*argv, "--skip-bad-lines"))
    preflight.check(
        _cfg(*arith_flags("--dynamic-sampling-filter-path", "check_reward_nonzero_std",
                    "--custom-rm-path", "my_plugins:reward"))
    )  # fmt: skip
    miles = "miles.rollout.filter_hub.dynamic_sampling_filters.check_no_aborted"
    preflight.check(_cfg(*arith_flags("--dynamic-sampling-filter-path", miles)))


def test_user_code_is_imported_from_the_workers_directory(work, monkeypatch):
    """The workers run `python -m millstream.cli` in this directory; the `millstream` script
    does not put it on sys.path, so preflight adds it while it imports (and only then)."""
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(work))])
    monkeypatch.delitem(sys.modules, "my_plugins", raising=False)
    preflight.check(_cfg(*arith_flags("--custom-rm-path", "my_plugins.reward")))
    assert str(work) not in sys.path


def test_a_miles_whole_batch_rollout_function_is_refused_saying_what_to_write(work, monkeypatch):
    monkeypatch.chdir(work)
    monkeypatch.delitem(sys.modules, "my_plugins", raising=False)
    with pytest.raises(ConfigError, match=r"^--rollout-function-path my_plugins.generate_rollout"):
        preflight.check(
            _cfg(*arith_flags("--rollout-function-path", "my_plugins.generate_rollout"))
        )
    try:
        preflight.check(
            _cfg(*arith_flags("--rollout-function-path", "my_plugins.generate_rollout"))
        )
    except ConfigError as err:
        assert "fn(group: PromptGroup, cfg, client: RouterClient) -> SampleGroup" in str(err)
    preflight.check(_cfg(*arith_flags("--rollout-function-path", "my_plugins.per_group")))
    with pytest.raises(ConfigError, match=r"^--custom-rm-path my_plugins.old_reward takes"):
        preflight.check(_cfg(*arith_flags("--custom-rm-path", "my_plugins.old_reward")))


def test_workers_elsewhere_are_not_checked_here(work, monkeypatch):
    """With --redis-url and --router-url this process starts no worker: their code, their
    packages and redis-server are theirs; the files the trainer reads are still checked."""
    monkeypatch.chdir(work)
    remote = ("--redis-url", "redis://r:6379/0", "--router-url", "http://router:30000")
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    preflight.check(_cfg(*arith_flags(*remote, "--custom-rm-path", "elsewhere.only.fn")))
    with pytest.raises(ConfigError, match=r"^--prompt-data"):
        preflight.check(_cfg(*_with(arith_flags(*remote), "--prompt-data", "missing.jsonl")))


@pytest.mark.parametrize(
    ("missing", "argv", "flag", "extra"),
    [
        ("fastapi", (), "--router-url", "serve"),
        ("transformers", (), "--train-backend", "model"),
        ("math_verify", (), "--reward-executor inline", "reward"),
        ("celery", ("--reward-executor", "celery"), "--reward-executor celery", "reward"),
    ],
)
def test_a_missing_extra_names_the_flag_and_the_extra(monkeypatch, missing, argv, flag, extra):
    real = preflight._installed
    monkeypatch.setattr(preflight, "_installed", lambda p: p != missing and real(p))
    with pytest.raises(ConfigError) as err:
        preflight.check(_cfg(*arith_flags(*argv)))
    assert str(err.value).startswith(flag) and missing in str(err.value)
    assert f"pip install 'millstream[{extra}]'" in str(err.value)


def test_ref_load_alone_cannot_start_local_engines():
    argv = arith_flags()
    argv[argv.index("--hf-checkpoint")] = "--ref-load"
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint is required to start local engines"):
        preflight.check(_cfg(*argv))
    preflight.check(_cfg(*argv, "--router-url", "http://127.0.0.1:9"))


def test_the_copies_match_their_originals():
    """The trainer and the config import no other service, and not torch at start: what
    they repeat from the reward hub, the filters and checkpoint.py must stay equal to the
    original."""
    from millstream.reward import filters, rm_hub
    from millstream.trainer.checkpoints import checkpoint

    assert (checks.RM_TYPES, checks.BOXED_PREFIX) == (rm_hub.RM_TYPES, rm_hub.BOXED_PREFIX)
    assert tuple(filters.BUILTINS) == preflight.BUILTIN_FILTERS
    assert (preflight.LATEST, preflight.STATE) == (checkpoint.LATEST, checkpoint.STATE)
    assert checkpoint.iter_dir("r", 5).name == "iter_0000005"


@pytest.mark.parametrize(
    "flags",
    [("--rm-type", "boxed_math"), ("--rm-type", " f1 "), ("--rm-type", "boxed_boxed_math"),
     ("--rm-type", "Math"), ("--rm-type", "remote_rm", "--rm-url", "http://rm:1"),
     ("--group-rm", "--rm-type", "exact"), ("--group-rm", "--custom-rm-path", "my_plugins.reward")],
)  # fmt: skip
def test_reward_config_is_judged_as_the_reward_worker_judges_it(work, monkeypatch, flags):
    from millstream.common.errors import MillstreamError
    from millstream.reward.rewarder import check_reward_config

    monkeypatch.chdir(work)
    cfg = _cfg(*arith_flags(*flags))
    try:
        check_reward_config(cfg)
        worker_ok = True
    except MillstreamError:
        worker_ok = False
    try:
        preflight.check(cfg)
        ok = True
    except ConfigError:
        ok = False
    assert ok == worker_ok


def test_tracking_flags_match_the_logging_config():
    cfg = _cfg(*arith_flags())
    for flag in preflight.TRACKING_PACKAGES:
        assert hasattr(cfg.logging, flag.removeprefix("--").replace("-", "_"))


def test_prompt_rows_are_read_with_the_data_sources_parser(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "metadata": [1]}) + "\n")
    with pytest.raises(ConfigError, match=r"p\.jsonl:1: .*--metadata-key 'metadata'"):
        preflight.check(_cfg(*_with(arith_flags(), "--prompt-data", str(path))))
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConfigError, match="--apply-chat-template"):
        preflight.check(_cfg(*_with(arith_flags(), "--prompt-data", str(path))))
    preflight.check(
        _cfg(*_with(arith_flags(), "--prompt-data", str(path)), "--apply-chat-template")
    )
