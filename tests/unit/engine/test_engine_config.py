"""`millstream engine` flags: typed, validated once, SGLang's names, no abbreviations."""

from __future__ import annotations

import subprocess
import sys

import pytest

from millstream.engine.config import parse_engine_config


def test_defaults_follow_sglang():
    cfg = parse_engine_config(["--model-path", "/m"])
    assert cfg.model_path == "/m"
    assert (cfg.host, cfg.port) == ("127.0.0.1", 30000)
    assert cfg.max_running_requests == 64
    assert cfg.weight_version == "default"
    assert cfg.dtype == "auto" and cfg.device == "auto"  # bfloat16 on a GPU, float32 on the CPU
    assert cfg.model_name == "/m"
    assert cfg.url == "http://127.0.0.1:30000"


def test_flags_parse_into_a_frozen_config():
    cfg = parse_engine_config(
        [
            "--model-path",
            "/m",
            "--port",
            "1234",
            "--max-running-requests",
            "8",
            "--dtype",
            "bfloat16",
            "--weight-version",
            "v7",
            "--register-with",
            "http://router:8000",
            "--served-model-name",
            "tiny",
        ]
    )
    assert (cfg.port, cfg.max_running_requests, cfg.dtype) == (1234, 8, "bfloat16")
    assert (cfg.weight_version, cfg.register_with, cfg.model_name) == (
        "v7",
        "http://router:8000",
        "tiny",
    )
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--model-path is required"),
        (["--model-path", "/m", "--max-running-requests", "0"], "--max-running-requests"),
        (["--model-path", "/m", "--dtype", "float16"], "--dtype"),
        (["--model-path", "/m", "--max-running"], "unrecognized arguments"),
        (["--model-path", "/m", "--weight-update-timeout", "0"], "--weight-update-timeout"),
        (["--model-path", "/m", "--max-request-bytes", "0"], "--max-request-bytes"),
        (["--model-path", "/m", "--admin-token", " "], "--admin-token must not be empty"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_engine_config(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_admin_token_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("MILLSTREAM_ADMIN_TOKEN", "secret")
    assert parse_engine_config(["--model-path", "/m"]).admin_token == "secret"
    cfg = parse_engine_config(["--model-path", "/m", "--admin-token", "flag"])
    assert cfg.admin_token == "flag"


def test_a_missing_model_dir_is_a_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "millstream.cli", "engine", "--model-path", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "no config.json" in proc.stderr and "Traceback" not in proc.stderr
