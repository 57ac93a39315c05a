"""Tracking: Miles' tags, x-axes, flags and custom log functions, read back from what was written.

MetricsLogger is driven directly with a RunConfig from the real parser; tensorboard's event
files are read with tensorboard's EventAccumulator, and the offline wandb run's .wandb file
with wandb's own protobuf records (wandb 0.31 has no Python reader: `_wandb_records` reads
the LevelDB-log framing it is written in, checking every chunk's CRC).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import struct
import sys
import zlib
from pathlib import Path

import pytest

from millstream.common.config import ConfigError, parse_run_config
from millstream.common.config import store as config_store
from millstream.common.config.logs import LoggingConfig
from millstream.common.errors import MillstreamError
from millstream.common.types import PromptGroup, Sample, SampleGroup, SampleStatus, ScoredGroup
from millstream.compat.miles import Sample as MilesSample
from millstream.trainer import preflight
from millstream.trainer.observe import log_hooks, metrics
from millstream.trainer.observe.metrics import MetricsLogger
from tests.support import log_plugins

REPO = Path(__file__).resolve().parents[4]
ARITH = REPO / "examples" / "arith"
PLUGINS = "tests.support.log_plugins"
FLAG_KEY = "flag-key-0123456789abcdef0123456789abcdef01"
ENV_KEY = "env-key-fedcba9876543210fedcba9876543210fe"

# Binary fractions: tensorboard keeps float32, and these survive it exactly.
ROW = {
    "loss": 0.25, "pg_loss": 0.125, "ess_ratio": 0.75, "grad_norm": 1.5, "lr": 0.5,
    "value_loss": 0.5, "value_clipfrac": 0.0625, "critic_grad_norm": 2.0, "critic_lr": 0.25,
    "raw_reward": 0.625, "response_len_mean": 12.0, "truncated_ratio": 0.5, "admitted": 4,
    "rollout_time": 3.0, "train_time": 2.0, "sync_time": 0.5, "total_time": 5.5,
    "completions_per_s": 8.0, "group_ids": ["g0", "g1"],
}  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_calls():
    log_plugins.CALLS.clear()
    yield
    log_plugins.CALLS.clear()


def _cfg(tmp_path: Path, *flags: str):
    """Two optimizer steps per rollout (4 samples, global batch 2), so train/step differs
    from rollout/step."""
    return parse_run_config(
        ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
         "--run-dir", str(tmp_path / "run"), *flags]
    )  # fmt: skip


def _groups() -> list[ScoredGroup]:
    return [
        ScoredGroup(
            group=SampleGroup(
                prompt=PromptGroup(group_id=f"g{g}", prompt_text=f"p{g}", data_index=10 + g),
                samples=[
                    Sample(group_id=f"g{g}", index=i, reward=float(i), response_text=f"r{g}{i}",
                           status=SampleStatus.SAMPLE_STATUS_COMPLETED)
                    for i in range(2)
                ],
            )
        )
        for g in range(2)
    ]  # fmt: skip


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -- the mapping ----------------------------------------------------------------------------

# Where the trainer computes a row's keys: `metrics["key"] = ...` anywhere in these files, and
# the dict literals of the named functions.
PRODUCERS = {
    "services/trainer/algorithms/loss.py": ("policy_loss", "value_loss"),
    "services/trainer/backends/loop.py": (),
    "services/trainer/batch.py": ("rollout_stats",),
    "services/trainer/trainer.py": ("_timings", "_counts"),
}


def _computed_keys() -> set[str]:
    keys: set[str] = set()
    for rel, functions in PRODUCERS.items():
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            if isinstance(node, ast.Assign | ast.AugAssign):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if (
                        isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "metrics"
                        and isinstance(t.slice, ast.Constant)
                    ):
                        keys.add(t.slice.value)
            if isinstance(node, ast.FunctionDef) and node.name in functions:
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Dict):
                        keys |= {k.value for k in sub.keys if isinstance(k, ast.Constant)}
    return keys


def test_every_metric_the_trainer_computes_has_its_miles_tag():
    keys = _computed_keys()
    # the scan finds them: the policy and critic losses, the backend, the rollout, the loop
    assert {"pg_clipfrac", "ess_ratio", "value_loss", "value_clipfrac", "critic_grad_norm",
            "lr", "raw_reward", "sync_time", "admitted", "engines_removed"} <= keys  # fmt: skip
    untagged = sorted(k for k in keys if k not in metrics.TAGS and k not in metrics.NOT_LOGGED)
    assert not untagged, f"add these to metrics.TAGS: {untagged}"


def test_tags_are_miles_names_and_unknown_keys_are_warned(caplog):
    tags = metrics.namespaced({**ROW, "eval/aime": 0.5, "perf/cpu_memory_gb": 3.0})
    assert tags == {
        "train/loss": 0.25, "train/pg_loss": 0.125, "train/ess_ratio": 0.75,
        "train/grad_norm": 1.5, "train/lr-pg_0": 0.5, "train/critic-value_loss": 0.5,
        "train/critic-value_clipfrac": 0.0625, "train/critic-grad_norm": 2.0,
        "train/critic-lr-pg_0": 0.25, "rollout/raw_reward": 0.625,
        "rollout/response_len/mean": 12.0, "rollout/truncated_ratio": 0.5,
        "rollout/admitted": 4, "perf/rollout_time": 3.0, "perf/train_time": 2.0,
        "perf/update_weights_time": 0.5, "perf/step_time": 5.5, "perf/completions_per_s": 8.0,
        "eval/aime": 0.5, "perf/cpu_memory_gb": 3.0,
    }  # fmt: skip
    with caplog.at_level("WARNING", logger="millstream.trainer.observe.metrics"):
        assert metrics.namespaced({"brand_new_metric": 1.0}) == {"rollout/brand_new_metric": 1.0}
    assert "brand_new_metric" in caplog.text and "metrics.TAGS" in caplog.text


# -- tensorboard ----------------------------------------------------------------------------


def test_tensorboard_has_miles_tags_at_miles_steps(tmp_path):
    tb = tmp_path / "tb"
    cfg = _cfg(tmp_path, "--tensorboard-dir", str(tb))
    logger = MetricsLogger(cfg, tmp_path / "run")
    logger.log_eval(0, {"eval/arith": 0.25, "eval/arith_failed_groups": 0})  # before training
    logger.log(1, {**ROW, "eval/arith": 0.5}, "row 1", groups=_groups())
    logger.log_eval(1, {"eval/arith": 0.5, "eval/arith_failed_groups": 1})
    logger.log(2, {**ROW, "loss": 0.75, "raw_reward": 0.875})
    logger.close()

    got = _scalars(tb)
    # train/step = rollout_id * 2 steps + the last step; rollout/ and perf/: the rollout_id
    assert got["train/loss"] == [(1, 0.25), (3, 0.75)]
    assert got["train/critic-value_loss"] == [(1, 0.5), (3, 0.5)]
    assert got["train/ess_ratio"] == [(1, 0.75), (3, 0.75)]
    assert got["rollout/raw_reward"] == [(0, 0.625), (1, 0.875)]
    assert got["perf/update_weights_time"] == [(0, 0.5), (1, 0.5)]
    # eval/step: before training and after rollout 0 are both rollout 0, as in Miles
    assert got["eval/arith"] == [(0, 0.25), (0, 0.5)]
    assert got["eval/arith_failed_groups"] == [(0, 0.0), (0, 1.0)]
    assert set(got) == set(metrics.namespaced(ROW)) | {"eval/arith", "eval/arith_failed_groups"}
    # metrics.jsonl: one row per iteration, every key, our own step
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["group_ids"] == ["g0", "g1"]
    assert rows[0]["eval/arith"] == 0.5 and rows[1]["loss"] == 0.75


def test_use_tensorboard_takes_miles_directory_rule(tmp_path, monkeypatch):
    import datetime

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    start = datetime.datetime(2026, 1, 2, 3, 4, 5)
    cfg = _cfg(tmp_path, "--use-tensorboard", "--tb-project-name", "proj")
    assert metrics.tensorboard_dir(cfg, now=start) == "tensorboard_log/proj/20260102_030405"
    named = _cfg(
        tmp_path, "--use-tensorboard", "--tb-project-name", "p", "--tb-experiment-name", "e"
    )
    assert metrics.tensorboard_dir(named) == "tensorboard_log/p/e"
    assert metrics.tensorboard_dir(named, environ={"TENSORBOARD_DIR": "/tb"}) == "/tb"
    explicit = _cfg(tmp_path, "--use-tensorboard", "--tensorboard-dir", "/x")
    assert metrics.tensorboard_dir(explicit, environ={"TENSORBOARD_DIR": "/tb"}) == "/x"
    assert metrics.tensorboard_dir(_cfg(tmp_path)) is None
    with pytest.raises(ConfigError, match=r"^--use-tensorboard needs --tb-project-name"):
        metrics.tensorboard_dir(_cfg(tmp_path, "--use-tensorboard"), environ={})
    # and the logger writes there
    monkeypatch.chdir(tmp_path)
    MetricsLogger(named, tmp_path / "run").close()
    assert list((tmp_path / "tensorboard_log" / "p" / "e").glob("events.out.tfevents.*"))


# -- wandb ----------------------------------------------------------------------------------


def _wandb_records(path: Path) -> list:
    """The Records of a .wandb file: a 7-byte header (':W&B', magic 0xBEE1, version 0), then
    LevelDB log records in 32 KiB blocks (crc32 of type+data, length, type: full 1, first 2,
    middle 3, last 4)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad chunk at {pos}"
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_has_miles_keys_under_the_run_dir_and_no_key(
    tmp_path, monkeypatch, capsys
):
    import wandb

    home = tmp_path / "home"
    for name, value in {
        "WANDB_API_KEY": ENV_KEY, "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true", "WANDB__DISABLE_STATS": "true",
        "WANDB__DISABLE_MACHINE_INFO": "true", "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run_dir = tmp_path / "run"
    cfg = _cfg(
        tmp_path, "--use-wandb", "--wandb-mode", "offline", "--wandb-project", "proj",
        "--wandb-group", "grp", "--wandb-team", "team", "--wandb-key", FLAG_KEY,
        "--run-id", "r1",
    )  # fmt: skip
    assert cfg.logging.wandb_key == FLAG_KEY
    config_store.write_file(cfg, run_dir)  # the trainer's config dump
    try:
        logger = MetricsLogger(cfg, run_dir)
        logger.log_eval(0, {"eval/arith": 0.25})
        logger.log(1, ROW, "[trainer] iter 1/2", groups=_groups())
        logger.log(2, {**ROW, "loss": 0.75})
        logger.close()
    finally:
        wandb.teardown()

    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(wandb_file)
    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    tags = metrics.namespaced(ROW)
    train = {t: v for t, v in tags.items() if t.startswith("train/")}
    rest = {t: v for t, v in tags.items() if not t.startswith("train/")}
    assert logged == [
        {"eval/arith": 0.25, "eval/step": 0},
        {**train, "train/step": 1},
        {**rest, "rollout/step": 0},
        {**train, "train/loss": 0.75, "train/step": 3},
        {**rest, "rollout/step": 1},
    ]
    defined = {
        r.metric.glob_name: r.metric.step_metric
        for r in records
        if r.WhichOneof("record_type") == "metric" and r.metric.glob_name
    }
    assert defined == dict(metrics.WANDB_DEFINE_METRICS)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.entity, run.run_group, run.display_name) == (
        "proj", "team", "grp", "r1"
    )  # fmt: skip
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["logging"]["wandb_project"] == "proj"
    assert config["logging"]["wandb_key"] is None
    # neither key anywhere: metrics.jsonl, config.json, the wandb files, the output
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert run_dir / "metrics.jsonl" in written and run_dir / "config.json" in written
    for path in written:
        text = path.read_bytes()
        assert FLAG_KEY.encode() not in text and ENV_KEY.encode() not in text, path
    out = capsys.readouterr()
    assert "[trainer] iter 1/2" in out.out
    assert FLAG_KEY not in out.out + out.err and ENV_KEY not in out.out + out.err


def test_wandb_init_takes_miles_flags_and_the_key_only_online(tmp_path):
    run_dir = tmp_path / "run"
    online = _cfg(
        tmp_path, "--use-wandb", "--wandb-key", FLAG_KEY, "--wandb-host", "https://wb.example",
        "--wandb-project", "p", "--wandb-team", "t", "--wandb-group", "g",
        "--wandb-dir", str(tmp_path / "wb"),
    )  # fmt: skip
    kwargs = metrics.wandb_init_kwargs(online, run_dir, environ={"WANDB_API_KEY": ENV_KEY})
    assert kwargs["settings"] == {
        "mode": "online", "init_timeout": 300.0, "api_key": FLAG_KEY,
        "base_url": "https://wb.example",
    }  # fmt: skip
    assert (kwargs["entity"], kwargs["project"], kwargs["group"]) == ("t", "p", "g")
    assert kwargs["dir"] == str(tmp_path / "wb") and kwargs["name"] == online.run_id
    assert FLAG_KEY not in json.dumps(kwargs["config"])
    # no flag: WANDB_API_KEY; the mode from WANDB_MODE; the run dir by default
    plain = _cfg(tmp_path, "--use-wandb")
    kwargs = metrics.wandb_init_kwargs(plain, run_dir, environ={"WANDB_API_KEY": ENV_KEY})
    assert kwargs["settings"]["api_key"] == ENV_KEY and kwargs["dir"] == str(run_dir)
    assert "api_key" not in metrics.wandb_init_kwargs(plain, run_dir, environ={})["settings"]
    env_offline = {"WANDB_MODE": "offline", "WANDB_API_KEY": ENV_KEY}
    assert metrics.wandb_init_kwargs(plain, run_dir, environ=env_offline)["settings"] == {
        "mode": "offline", "init_timeout": 300.0
    }  # fmt: skip
    offline = _cfg(tmp_path, "--use-wandb", "--wandb-mode", "offline", "--wandb-key", FLAG_KEY)
    settings = metrics.wandb_init_kwargs(offline, run_dir, environ={})["settings"]
    assert "api_key" not in settings and settings["mode"] == "offline"


def test_the_published_config_has_no_wandb_key(tmp_path):
    cfg = _cfg(tmp_path, "--use-wandb", "--wandb-key", FLAG_KEY)
    assert FLAG_KEY not in config_store.dumps(cfg)
    assert config_store.without_secrets(cfg).logging.wandb_key is None


# -- the custom log functions ---------------------------------------------------------------


def _hooked(tmp_path: Path, *flags: str) -> MetricsLogger:
    cfg = _cfg(tmp_path, "--tensorboard-dir", str(tmp_path / "tb"), "--wandb-key", FLAG_KEY,
               *flags)  # fmt: skip
    return MetricsLogger(cfg, tmp_path / "run")


def test_the_custom_rollout_log_function_gets_miles_arguments(tmp_path):
    logger = _hooked(tmp_path, "--custom-rollout-log-function-path", f"{PLUGINS}.record_rollout")
    logger.log(1, ROW, groups=_groups())
    logger.log(2, ROW, groups=_groups())
    logger.close()
    assert [c[0] for c in log_plugins.CALLS] == ["rollout", "rollout"]
    rollout_id, args, samples, extra, rollout_time = log_plugins.CALLS[0][1]
    assert rollout_id == 0 and log_plugins.CALLS[1][1][0] == 1
    # Miles' args (flat, read-only, no secrets) and Miles' Samples, as Miles' docs show them
    assert args.n_samples_per_prompt == 2 and args.wandb_key is None
    assert [(s.group_id, s.group_index, s.prompt, s.reward, s.response) for s in samples] == [
        ("g0", 10, "p0", 0.0, "r00"), ("g0", 10, "p0", 1.0, "r01"),
        ("g1", 11, "p1", 0.0, "r10"), ("g1", 11, "p1", 1.0, "r11"),
    ]  # fmt: skip
    assert all(isinstance(s, MilesSample) and s.status == MilesSample.Status.COMPLETED
               for s in samples)  # fmt: skip
    assert extra == {
        "rollout/raw_reward": 0.625, "rollout/response_len/mean": 12.0,
        "rollout/truncated_ratio": 0.5, "rollout/admitted": 4,
    }  # fmt: skip
    assert rollout_time == 3.0
    assert _scalars(tmp_path / "tb")["rollout/raw_reward"] == [(0, 0.625), (1, 0.625)]


def test_a_true_return_skips_the_default_rollout_logging_but_not_metrics_jsonl(tmp_path):
    logger = _hooked(tmp_path, "--custom-rollout-log-function-path", f"{PLUGINS}.skip_rollout")
    logger.log(1, ROW, groups=_groups())
    logger.close()
    assert len(log_plugins.CALLS) == 1
    got = _scalars(tmp_path / "tb")
    assert not [t for t in got if t.startswith("rollout/")]
    assert got["train/loss"] == [(1, 0.25)] and got["perf/rollout_time"] == [(0, 3.0)]
    assert _rows(tmp_path / "run")[0]["raw_reward"] == 0.625


def test_the_custom_eval_log_function_gets_miles_arguments_and_may_skip(tmp_path):
    data = {"arith": {"rewards": [1.0, 0.0], "truncated": [False, True], "samples": []}}
    logger = _hooked(tmp_path, "--custom-eval-rollout-log-function-path", f"{PLUGINS}.record_eval")
    logger.log_eval(0, {"eval/arith": 0.5}, data)
    logger.log_eval(3, {"eval/arith": 0.75, "eval/arith_seconds": 2.0}, data)
    logger.close()
    (_, first), (_, second) = log_plugins.CALLS
    assert first[0] == 0 and first[1].wandb_key is None
    assert first[2] is data and first[3] == {"eval/arith": 0.5}
    assert second[0] == 2 and second[3] == {"eval/arith": 0.75, "eval/arith_seconds": 2.0}
    assert _scalars(tmp_path / "tb")["eval/arith"] == [(0, 0.5), (2, 0.75)]

    skipped = tmp_path / "skipped"
    skipped.mkdir()
    logger = _hooked(skipped, "--custom-eval-rollout-log-function-path", f"{PLUGINS}.skip_eval")
    logger.log_eval(0, {"eval/arith": 0.5}, data)
    logger.log(1, ROW)
    logger.close()
    assert len(log_plugins.CALLS) == 3
    assert not [t for t in _scalars(skipped / "tb") if t.startswith("eval/")]


@pytest.mark.parametrize(
    ("flag", "fn", "call", "error"),
    [
        (log_hooks.ROLLOUT, "raising_rollout", "rollout", "ValueError: statsd is down"),
        (log_hooks.EVAL, "raising_eval", "eval", "KeyError: 'aime'"),
        (log_hooks.ROLLOUT, "async_rollout", "rollout", "returned an awaitable"),
    ],
)
def test_an_error_in_a_custom_log_function_names_it(tmp_path, flag, fn, call, error):
    logger = _hooked(tmp_path, flag, f"{PLUGINS}.{fn}")
    with pytest.raises(MillstreamError) as err:
        if call == "rollout":
            logger.log(1, ROW, groups=_groups())
        else:
            logger.log_eval(0, {"eval/arith": 0.5}, {})
    logger.close()
    assert str(err.value).startswith(f"{flag} '{PLUGINS}.{fn}'") and error in str(err.value)


# -- flags and preflight --------------------------------------------------------------------

REMOTE = ("--redis-url", "redis://r:6379/0", "--router-url", "http://router:30000")


def _preflight_cfg(tmp_path: Path, *extra: str):
    """A valid run (the arith example's model, one prompt) with services elsewhere: no worker
    is started here."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return parse_run_config(
        ["--hf-checkpoint", str(ARITH / "model"), "--prompt-data", str(prompts),
         "--input-key", "prompt", "--label-key", "label", "--rm-type", "exact",
         "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
         *REMOTE, *extra]
    )  # fmt: skip


def test_preflight_loads_the_log_functions_as_the_trainer_does(tmp_path, monkeypatch):
    """The functions run in the trainer, so they are checked even with the workers elsewhere,
    from the working directory, which the `millstream` script does not put on sys.path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_logs.py").write_text(
        "def log(rollout_id, args, samples, extra, t):\n    pass\n"
    )
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_logs", raising=False)
    for flag in (log_hooks.ROLLOUT, log_hooks.EVAL):
        preflight.check(_preflight_cfg(tmp_path, flag, "my_logs.log"))
        with pytest.raises(ConfigError, match=rf"^{flag} 'my_logs.nope': .* has no 'nope'"):
            preflight.check(_preflight_cfg(tmp_path, flag, "my_logs.nope"))
        with pytest.raises(ConfigError, match=rf"^{flag} 'no_such_module.fn': cannot import"):
            preflight.check(_preflight_cfg(tmp_path, flag, "no_such_module.fn"))
    assert str(tmp_path) not in sys.path


@pytest.mark.parametrize(
    "flags",
    [
        ("--use-wandb",),
        ("--tensorboard-dir", "tb"),
        ("--use-tensorboard", "--tb-project-name", "p"),
    ],
)
def test_a_missing_tracking_package_stops_preflight_naming_the_extra(tmp_path, monkeypatch, flags):
    flag = flags[0]
    package = metrics.TRACKING_PACKAGES[flag]
    real = preflight._installed
    monkeypatch.setattr(preflight, "_installed", lambda p: p != package and real(p))
    with pytest.raises(ConfigError) as err:
        preflight.check(_preflight_cfg(tmp_path, *flags))
    assert str(err.value).startswith(f"{flag} needs the {package} package")
    assert "pip install 'millstream[track]'" in str(err.value)
    monkeypatch.setattr(preflight, "_installed", real)
    preflight.check(_preflight_cfg(tmp_path, *flags))


def test_use_tensorboard_without_a_directory_stops_preflight(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with pytest.raises(ConfigError, match=r"^--use-tensorboard needs --tb-project-name"):
        preflight.check(_preflight_cfg(tmp_path, "--use-tensorboard"))


def test_every_logging_flag_parses_and_is_read_by_the_trainer(tmp_path):
    cfg = _cfg(
        tmp_path, "--use-wandb", "--wandb-project", "p", "--wandb-group", "g", "--wandb-team",
        "t", "--wandb-key", "k", "--wandb-host", "h", "--wandb-mode", "offline", "--wandb-dir",
        "d", "--use-tensorboard", "--tb-project-name", "tp", "--tb-experiment-name", "te",
        "--tensorboard-dir", "tb", "--custom-rollout-log-function-path", "a.b",
        "--custom-eval-rollout-log-function-path", "c.d", "--log-passrate",
    )  # fmt: skip
    given = dataclasses.asdict(cfg.logging)
    assert given == {f.name: given[f.name] for f in dataclasses.fields(LoggingConfig)}
    assert all(value not in (None, False) for value in given.values()), given
    # each field is read where the trainer tracks (not just parsed)
    source = "".join(
        (REPO / "services" / "trainer" / name).read_text()
        for name in ("observe/metrics.py", "observe/log_hooks.py", "preflight.py")
    )
    unread = [
        f.name for f in dataclasses.fields(LoggingConfig) if not re.search(rf"\.{f.name}\b", source)
    ]
    assert not unread, unread
    with pytest.raises(SystemExit) as exit_info:
        _cfg(tmp_path, "--wandb-key", " ")
    assert exit_info.value.code == 2


def test_what_a_log_function_hands_to_miles_tracking_log_lands_in_the_row_and_mirrors(tmp_path):
    logger = _hooked(tmp_path, "--custom-rollout-log-function-path", f"{PLUGINS}.tracked_rollout")
    logger.log(1, ROW, groups=_groups())
    logger.close()
    row = _rows(tmp_path / "run")[0]
    assert row["rollout/my_reward/mean"] == 0.5 and row["rollout/my_reward/max"] == 1.0
    assert "rollout/step" not in row
    got = _scalars(tmp_path / "tb")
    assert got["rollout/my_reward/mean"] == [(0, 0.5)] and "rollout/raw_reward" not in got
