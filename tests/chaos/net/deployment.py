"""The chaos `Deployment` with every service in a network namespace of its own, so that a
partition is silence between hosts rather than a refusal on loopback.

    d = NetDeployment(workdir, model, prompts, engines=2, rollout=2)
    trainer = d.start_trainer(200)
    d.net.partition("engine-1", 20)       # tests/chaos/net/netns.py
    result = d.finish(trainer)            # harness.Deployment's: exit code, counts, trained twice
    d.stop()                              # every process killed, every namespace deleted

Each role (`redis`, `router`, `engine-<i>`, `rollout-<i>`, `reward-<i>`, `trainer`, and
`trainer-<i>` for more trainers) gets a namespace and an address; each service binds and
advertises it (`--host`, `redis-server --bind`); engines join the trainer's Coordinator at
`TRAINER_ADDRESS:COORDINATOR_PORT`, workers are given the Redis URL and read the router's URL
from the run config. `probe` is the harness's own namespace: its HTTP and Redis questions
(`net.call_in("probe", ...)`) cross the bridge like any service's.

As between hosts, the weights go by the update group (`--update-weight-transport nccl`: gloo
on the CPU) with the trainer's address as its rendezvous; without it `auto` sees one machine
(one /dev/shm) and hands the engines shared memory over HTTP. Each process is told to use
`eth0` for gloo (GLOO_SOCKET_IFNAME): this machine's hostname resolves to 127.0.0.1, which
gloo would otherwise advertise to its peers.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from tests.chaos.harness import HEALTH_INTERVAL_S, Deployment
from tests.support.router_proc import ROOT
from tests.support.worker_procs import WorkerProcs

from .netns import Network

REDIS_PORT = 6379
SERVICE_PORT = 30000  # the router's and each engine's (each has its own address)
COORDINATOR_PORT = 50051


def service_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "eth0"}  # fmt: skip


class NsProcess:
    """One service process in `role`'s namespace, logging to `workdir/<role>.log` (appended
    to across restarts); what the chaos code uses of router_proc.ServiceProcess."""

    def __init__(self, net: Network, role: str, argv: list[str], workdir: Path, port: int):
        self.net = net
        self.role = role
        self.port = port
        self.log_path = workdir / f"{role}.log"
        self._log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            net.argv(role, argv), cwd=ROOT, env=service_env(), stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://{self.net.address(self.role)}:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, path: str, timeout_s: float = 120.0) -> NsProcess:
        """Poll GET `path` from the probe namespace until it answers 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                answer = self.net.call_in("probe", httpx.get, self.url + path, timeout=2)
                if answer.status_code == 200:
                    return self
            time.sleep(0.2)
        raise RuntimeError(
            f"{self.role}: no answer to {path} in {timeout_s:g} s:\n{self.log_tail()}"
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if not self._log.closed:
            self._log.close()


class NsRedis(NsProcess):
    """redis-server with its append-only file, bound to its namespace's address."""

    def __init__(self, net: Network, workdir: Path):
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
        argv = ["redis-server", "--bind", net.address("redis"), "--port", str(REDIS_PORT),
                "--protected-mode", "no", "--dir", str(workdir / "redis"), "--save", "",
                "--appendonly", "yes", "--daemonize", "no", "--loglevel", "warning",
                "--maxmemory-policy", "noeviction"]  # fmt: skip
        super().__init__(net, "redis", argv, workdir, REDIS_PORT)

    @property
    def url(self) -> str:
        return f"redis://{self.net.address('redis')}:{REDIS_PORT}/0"

    def wait_ready(self, path: str = "", timeout_s: float = 10.0) -> NsRedis:
        """Until it answers PING from the probe namespace (`path`: none for Redis)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if self.net.call_in("probe", self.ping):
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"redis did not answer in {timeout_s:g} s:\n{self.log_tail()}")

    def ping(self) -> bool:
        with redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2) as c:
            return bool(c.ping())


class NsWorkerProcs(WorkerProcs):
    """Rollout and reward workers, each in the namespace named after it (`rollout-0`)."""

    def __init__(self, net: Network, redis_url: str, run_id: str, log_dir: Path):
        super().__init__(redis_url, run_id, log_dir)
        self.net = net

    def spawn(self, command: str, name: str, extra) -> subprocess.Popen:
        argv = [sys.executable, "-m", "millstream.cli", command]
        argv += ["--redis-url", self.redis_url, "--run-id", self.run_id, *extra]
        with (self.log_dir / f"{name}.log").open("a") as log:
            proc = subprocess.Popen(
                self.net.argv(name, argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                env=service_env(),
            )  # fmt: skip
        self.procs[name] = proc
        return proc


class NetDeployment(Deployment):
    """harness.Deployment's run, service by service, each in its namespace. Its waits,
    `finish` and trainer flags are the loopback harness's; what differs is where each
    process lives and how the harness reaches it (from `probe`)."""

    def __init__(
        self,
        workdir: Path,
        model: Path,
        prompts: Path,
        *,
        run_id: str = "chaos-net",
        engines: int = 1,
        rollout: int = 1,
        reward: int = 1,
        trainers: int = 1,
    ):
        roles = ["redis", "router"]
        roles += [f"engine-{i}" for i in range(engines)]
        roles += [f"rollout-{i}" for i in range(rollout)]
        roles += [f"reward-{i}" for i in range(reward)]
        roles += ["trainer"] + [f"trainer-{i}" for i in range(1, trainers)]
        self.net = Network([*roles, "probe"])
        self.workdir, self.model, self.prompts, self.run_id = workdir, model, prompts, run_id
        self.run_dir = workdir / "run"
        self.trainer_log = workdir / "trainer.log"
        self.coordinator_port = COORDINATOR_PORT
        self.num_rollout = 0
        self.trainers: list[subprocess.Popen] = []
        self.services: list[NsProcess] = []  # what `stop` kills, the workers aside
        self.engines: list[NsProcess] = []
        redis_url = f"redis://{self.net.address('redis')}:{REDIS_PORT}/0"
        self.workers = NsWorkerProcs(self.net, redis_url, run_id, workdir)
        try:
            self.redis = self._started(NsRedis(self.net, workdir)).wait_ready()
            router = NsProcess(self.net, "router", self._service("router", "router"), workdir,
                               SERVICE_PORT)  # fmt: skip
            self.router = self._started(router).wait_ready("/liveness", 60)
            self.engines = [self.start_engine(f"engine-{i}") for i in range(engines)]
            for i in range(rollout):
                self.spawn_worker("rollout", f"rollout-{i}")
            for i in range(reward):
                self.spawn_worker("reward", f"reward-{i}")
        except BaseException:
            self.stop()
            raise

    def _started(self, service: NsProcess) -> NsProcess:
        self.services.append(service)
        return service

    def _service(self, command: str, role: str) -> list[str]:
        argv = [sys.executable, "-m", "millstream.cli", command, "--host", self.net.address(role)]
        argv += ["--port", str(SERVICE_PORT), "--log-level", "warning"]
        if command == "router":
            argv += ["--health-check-interval", str(HEALTH_INTERVAL_S)]
        return argv

    def start_engine(self, role: str = "engine-0") -> NsProcess:  # type: ignore[override]
        """An engine in `role`'s namespace; it asks the trainer's Coordinator to join (the
        trainer may start after it: JoinEngine is retried)."""
        argv = self._service("engine", role)
        argv += ["--model-path", str(self.model), "--num-threads", "1", "--weight-version", "0",
                 "--coordinator", f"{self.net.address('trainer')}:{COORDINATOR_PORT}"]  # fmt: skip
        return self._started(NsProcess(self.net, role, argv, self.workdir, SERVICE_PORT))

    def start_trainer(
        self, num_rollout: int, *extra: str, role: str = "trainer"
    ) -> subprocess.Popen:
        """A trainer in `role`'s namespace, logging to `<role>.log` (the log `finish` reads
        is the last started trainer's). Weights go by the update group, rendezvous at its
        own address."""
        self.num_rollout = num_rollout
        self.trainer_log = self.workdir / f"{role}.log"
        argv = self.trainer_argv(
            num_rollout, "--update-weight-transport", "nccl",
            "--weight-sync-master-address", self.net.address(role), *extra,
        )  # fmt: skip
        with self.trainer_log.open("a") as log:
            trainer = subprocess.Popen(
                self.net.argv(role, argv), cwd=ROOT, env=service_env(), stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.trainers.append(trainer)
        return trainer

    def _get(self, url: str) -> httpx.Response:
        return self.net.call_in("probe", httpx.get, url, timeout=5)

    def engine_eligible(self, url: str) -> bool:
        workers = self._get(f"{self.router.url}/workers").json()["workers"]
        return any(w["url"] == url and w.get("eligible") for w in workers)

    def engine_version(self, url: str) -> str:
        return self._get(f"{url}/get_weight_version").json()["weight_version"]

    def stop(self) -> None:
        """SIGKILL every process, then delete the namespaces (with whatever is left in them)."""
        try:
            for trainer in self.trainers:
                if trainer.poll() is None:
                    trainer.kill()
                trainer.wait()
            for name in list(self.workers.procs):
                self.workers.kill(name)
            for service in self.services:
                service.kill()
        finally:
            self.net.close()
