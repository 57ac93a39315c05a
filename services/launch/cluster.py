"""The local cluster of `millstream train`: start what the flags leave out, watch it, stop it.

Without --redis-url and --router-url, one command runs the whole loop on this machine:

    cluster = LocalCluster(cfg, model_path=actor_hf_dir, weight_version="3")
    try:
        urls = await cluster.start_infra()          # redis-server, engines, router
        cfg = urls.apply(cfg)                       # the URLs go into the run config ...
        await config_store.publish(redis, cfg)      # ... which workers read at start
        await cluster.start_workers()               # rollout and reward workers
        await train_until_done_or(cluster.watch())  # a dead child stops the run
    finally:
        cluster.stop()

What is started follows what is missing: no --redis-url -> a private redis-server in
`{run_dir}/redis/` (append-only file on, so a restarted run finds its streams); no
--router-url -> `--rollout-num-engines` engines and a router in front of them. Workers
(`--num-rollout-workers`, `--num-reward-workers`, plus Celery reward workers with
`--reward-executor celery`) are started whenever anything is, and with both URLs given
nothing is: the trainer joins an existing deployment.

Invariants: no child outlives the trainer (see `procs`: death signal, even on SIGKILL);
every child is healthy before `start_*` returns (engine and router answer, Redis answers
PING, a worker's heartbeat key exists); a child that exits before `stop()` is an error that
names it and shows the last lines of its log (`ServiceExited`); `stop()` is idempotent and
stops workers first, then the router, the engines, and Redis last.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import httpx

from millstream.common import threads
from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError
from millstream.common.http_pool import make_client
from millstream.common.keys import RunKeys
from millstream.common.redis_conn import connect, redact

from . import engines as engine_commands
from .plan import (
    GpuPlan,
    cpu_budget,
    engine_device_args,
    given_router_url,
    gpu_plan,
    sglang_engine_command,
    visible_devices,
)
from .procs import (
    Child,
    RunDirLock,
    describe_exit,
    free_port,
    kill_children,
    spawn,
    stop_children,
)

HOST = "127.0.0.1"
TAIL_LINES = 20
PROGRESS_EVERY_S = 15.0
HEALTH_POLL_S = 0.05  # a start-up wait polls this often: each round is a refused connect or a GET
TORCHRUN_ENV = frozenset(
    [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    ]
)

# Shutdown order: the highest tier stops first.
TIER_REDIS, TIER_ENGINE, TIER_ROUTER, TIER_WORKER = range(4)


class ServiceExited(MillstreamError):
    """A child service exited while the run needed it; the message carries its log tail."""

    def __init__(self, child: Child, code: int, when: str):
        self.name, self.returncode, self.log_path = child.name, code, child.log_path
        self.tail = child.tail(TAIL_LINES)
        super().__init__(
            f"{child.name} exited with {describe_exit(code)} {when}; last lines of "
            f"{child.log_path}:\n{_indent(self.tail)}\n(the whole log is in {child.log_path})"
        )


@dataclass(frozen=True)
class LaunchTimeouts:
    """Seconds each kind of service may take to become healthy, and each tier to stop."""

    redis_s: float = 20.0
    engine_s: float = 120.0
    # An SGLang server imports far more, and on a GPU loads and captures CUDA graphs before it
    # answers /health: minutes for a multi-billion-parameter model (Miles waits as long).
    sglang_s: float = 600.0
    router_s: float = 30.0
    worker_s: float = 60.0
    stop_s: float = 10.0


@dataclass(frozen=True)
class ClusterUrls:
    """Where the run's services are: given by flags or started here."""

    redis_url: str
    router_url: str
    engine_urls: tuple[str, ...] = ()

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` pointing at these services: the config to publish for the workers."""
        return replace(
            cfg,
            connection=replace(cfg.connection, redis_url=self.redis_url),
            service=replace(cfg.service, router_url=self.router_url),
        )


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _say(message: str) -> None:
    print(f"[launcher] {message}", flush=True)


class LocalCluster:
    """Starts, watches and stops the services a run needs locally (module docstring).

    `model_path`: what engines load (default --hf-checkpoint; a resumed trainer passes its
    checkpoint's HF weights). `weight_version`: the version engines report until the first
    sync. `say`: where progress lines go. Call `start_*` from the main thread (see `procs`).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        model_path: str | None = None,
        weight_version: str = "0",
        timeouts: LaunchTimeouts | None = None,
        say: Callable[[str], None] = _say,
    ):
        self.cfg = cfg
        self.model_path = model_path
        self.weight_version = weight_version
        self.timeouts = timeouts or LaunchTimeouts()
        self.say = say
        self.run_dir = Path(cfg.run_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.redis_password = (
            cfg.connection.redis_password or os.environ.get("REDIS_PASSWORD") or None
        )
        self.starts_anything = not cfg.connection.redis_url or given_router_url(cfg) is None
        self.budget = cpu_budget(cfg)
        self.plan: GpuPlan | None = None  # made when engines are started (it imports torch)
        self.sglang_engines: dict[str, tuple[int, ...]] = {}  # URL -> its GPUs
        self.engine_start_s = self.timeouts.engine_s  # the engines' health wait, by kind
        self.children: list[Child] = []
        self.urls: ClusterUrls | None = None
        self._state = "running"  # -> "stopping" -> "stopped"
        self._lock = RunDirLock(self.run_dir)
        # spawn_infra -> wait_infra: the health waits of what was spawned and not waited for
        self._infra_waits: Callable[[httpx.AsyncClient], list[Coroutine[Any, Any, None]]] | None = (
            None
        )

    @property
    def pids(self) -> dict[str, int]:
        return {child.name: child.pid for child in self.children}

    # -- start ----------------------------------------------------------------------------

    async def start_infra(self) -> ClusterUrls:
        """Redis, engines and router, as far as the flags leave them out; healthy on return."""
        urls = await self.spawn_infra()
        await self.wait_infra()
        return urls

    async def spawn_infra(self) -> ClusterUrls:
        """Redis (healthy on return), and the engines and router spawned: their URLs are
        known at once, so the run config can be published and workers started while the
        engines load their model (`wait_infra` then waits for them)."""
        if self.urls is not None:
            return self.urls
        if self._state != "running":
            raise MillstreamError("this LocalCluster was stopped; build a new one")
        if self.starts_anything:
            try:
                self._lock.acquire()
            except BlockingIOError as err:
                raise MillstreamError(
                    f"another launcher ({err}) is running services for run dir {self.run_dir}: "
                    "stop it, or give this run another --run-dir"
                ) from None
        if self.starts_anything:
            self.say(self.budget.describe())
        try:
            engine_urls: tuple[str, ...] = ()
            router_url = given_router_url(self.cfg)
            if router_url is None:
                # Engines and router start together, and first (they need no Redis): the
                # router's readiness already waits for an engine, and the engines' model
                # loading is most of the start-up.
                engine_urls, engines_ready = self._spawn_engines()
                router_url, router_ready = self._spawn_router(engine_urls)
                self._infra_waits = lambda client: [*engines_ready(client), router_ready(client)]
            redis_url = self.cfg.connection.redis_url or await self._start_redis()
        except BaseException:
            self.stop()
            raise
        self.urls = ClusterUrls(redis_url, router_url, engine_urls)
        return self.urls

    async def wait_infra(self) -> None:
        """Until the engines and router `spawn_infra` started are healthy (stops all if not)."""
        waits, self._infra_waits = self._infra_waits, None
        if waits is None:
            return
        try:
            async with make_client(httpx.Timeout(2.0)) as client:
                await run_all(waits(client))
        except BaseException:
            self.stop()
            raise

    async def start_workers(self) -> None:
        """Rollout and reward workers (after the run config is published); healthy on return.

        On any failure while starting, `start_*` stops what it started and re-raises."""
        if self.urls is None:
            raise RuntimeError("spawn_infra() first: workers need the Redis and router URLs")
        if not self.starts_anything or any(c.tier == TIER_WORKER for c in self.children):
            return
        redis = await connect(self.urls.redis_url, self.redis_password)
        try:
            if not await redis.exists(RunKeys(self.cfg.run_id).config):
                raise MillstreamError(
                    f"no run config at {RunKeys(self.cfg.run_id).config!r} in "
                    f"{redact(self.urls.redis_url)}: publish it before starting workers"
                )
            await self._start_workers(redis)
        except BaseException:
            self.stop()
            raise
        finally:
            await redis.aclose()

    async def finish_start(self) -> None:
        """`wait_infra` and `start_workers` together (after the run config is published):
        workers need only Redis to start, so they do while the engines load their model."""
        await run_all([self.wait_infra(), self.start_workers()])

    async def __aenter__(self) -> LocalCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()

    def engine_placements(self) -> dict[str, dict[str, Any]]:
        """Where the SGLang servers started here live (they do not say so themselves; the
        weight sync needs it to tell the trainer's GPU from another: trainer/weights/)."""
        if not self.sglang_engines:
            return {}
        from millstream.common import tensor_share  # torch: only with SGLang servers started

        return {
            url: tensor_share.placement(f"cuda:{gpus[0]}" if gpus else "cpu")
            for url, gpus in self.sglang_engines.items()
        }

    # -- watch and stop -------------------------------------------------------------------

    def check(self) -> None:
        """Raise ServiceExited if any child has exited (before `stop()` was asked for)."""
        if self._state != "running":
            return
        for child in self.children:
            code = child.poll()
            if code is not None:
                raise ServiceExited(child, code, "while the run was going")

    async def watch(self, interval_s: float = 1.0) -> NoReturn:
        """`check()` every interval, forever: run it beside training; it raises on a death."""
        while True:
            self.check()
            await asyncio.sleep(interval_s)

    def stop(self) -> None:
        """Stop every child: SIGTERM tier by tier (workers, router, engines, Redis), bounded
        waits, SIGKILL for leftovers. Idempotent; called again while stopping (a second
        Ctrl-C, a signal handler), it SIGKILLs everything at once."""
        if self._state == "stopping":
            kill_children(self.children)
            return
        if self._state == "stopped":
            return
        self._state = "stopping"
        try:
            running = [c for c in self.children if c.poll() is None]
            if running:
                self.say(f"stopping {len(running)} local service(s)")
            for tier in sorted({c.tier for c in self.children}, reverse=True):
                members = [c for c in reversed(self.children) if c.tier == tier]
                start = time.monotonic()
                stop_children(members, self.timeouts.stop_s)
                names = ", ".join(c.name for c in members)
                self.say(f"stopped {names} ({time.monotonic() - start:.1f}s)")
        finally:
            kill_children(self.children)
            self._state = "stopped"
            self._lock.release()

    # -- the services ---------------------------------------------------------------------

    def _service_argv(self, command: str, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "millstream.cli",
            command,
            *args,
            "--run-dir",
            str(self.run_dir),
            "--log-level",
            self.cfg.connection.log_level,
        ]

    def _env(self, num_threads: int = 1, **extra: str | None) -> dict[str, str]:
        # A trainer under torchrun: its services are not ranks of the trainer's group.
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        env["PYTHONUNBUFFERED"] = "1"
        env.update(threads.pool_env(num_threads))
        env.update({k: v for k, v in extra.items() if v})
        return env

    def _spawn(
        self,
        name: str,
        argv: list[str],
        tier: int,
        env: dict[str, str] | None = None,
        death_signal: int = signal.SIGTERM,
    ) -> Child:
        child = spawn(
            name, argv, self.log_dir / f"{name}.log", tier=tier, env=env, death_signal=death_signal
        )
        self.children.append(child)
        return child

    async def _start_redis(self) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise MillstreamError(
                "redis-server is not on PATH: install it (Debian: apt-get install redis-server) "
                "or pass --redis-url to use an existing Redis"
            )
        port = free_port(HOST)
        conf = self._write_redis_conf(port)
        child = self._spawn("redis", [binary, str(conf)], TIER_REDIS)
        url = f"redis://{HOST}:{port}/0"

        async def ready() -> bool:
            try:
                client = await connect(url, self.redis_password, timeout_s=1.0)
            except MillstreamError:
                return False
            await client.aclose()
            return True

        await self._wait_healthy(child, ready, self.timeouts.redis_s, url)
        return url

    def _write_redis_conf(self, port: int) -> Path:
        """redis.conf in `{run_dir}/redis/` (mode 0600: it may hold the password, which is
        thereby kept off the process list)."""
        data_dir = self.run_dir / "redis"
        data_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            f"port {port}",
            f"bind {HOST}",
            f'dir "{_conf_quote(str(data_dir))}"',
            "daemonize no",
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            'logfile ""',
            "loglevel notice",
            # Never evict: an evicted stream entry is a group lost without a trace; at a
            # maxmemory, writes wait for room instead (common/redis_conn.py).
            "maxmemory-policy noeviction",
        ]
        if self.redis_password:
            lines.append(f'requirepass "{_conf_quote(self.redis_password)}"')
        path = data_dir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(path, 0o600)
        return path

    def _spawn_engines(
        self,
    ) -> tuple[tuple[str, ...], Callable[[httpx.AsyncClient], list[Coroutine[Any, Any, None]]]]:
        """Spawn the engines; returns their URLs and the waits for their health."""
        model = self.model_path or self.cfg.ckpt.hf_checkpoint
        if not model:
            raise MillstreamError(
                "--hf-checkpoint is required to start local engines (or pass --router-url "
                "to use running ones)"
            )
        if not Path(model).is_dir():
            raise MillstreamError(f"engine model path {model!r} is not a directory")
        self.plan = plan = gpu_plan(self.cfg, visible_devices())  # children get these ids
        self.say(plan.describe())
        sglang = engine_commands.sglang_installed()
        engine_commands.check(self.cfg, sglang)
        started = []
        for i in range(len(plan.engines)):
            port = free_port(HOST)
            env = self._env(
                self.budget.engine,
                MILLSTREAM_ADMIN_TOKEN=self.cfg.service.admin_token,
                # SGLang on the CPU: its CPU engine, which needs no vllm for the rotary
                # embedding (a user's own setting wins)
                SGLANG_USE_CPU_ENGINE=(
                    os.environ.get("SGLANG_USE_CPU_ENGINE", "1")
                    if sglang and not plan.engines[i]
                    else None
                ),
                **plan.engine_env(i),
            )
            if sglang:
                argv = sglang_engine_command(
                    self.cfg, plan, i, str(Path(model).resolve()), HOST, port,
                    str(self.weight_version),
                ).argv  # fmt: skip
            else:
                argv = self._service_argv(
                    "engine",
                    "--model-path",
                    str(Path(model).resolve()),
                    "--host",
                    HOST,
                    "--port",
                    str(port),
                    "--weight-version",
                    str(self.weight_version),
                    "--max-running-requests",
                    str(self.cfg.sglang.engine_max_running_requests),
                    "--weight-update-timeout",
                    str(self.cfg.sglang.weight_sync_timeout),
                    "--num-threads",
                    str(self.budget.engine),
                    *engine_device_args(plan, self.cfg, i),
                ) + engine_commands.engine_flags(self.cfg)  # the user's --sglang-X win
            # SIGKILL as the death signal: the engine ignores SIGTERM while it loads its model,
            # and a death signal is sent once; a lost one would leave an orphan.
            child = self._spawn(f"engine-{i}", argv, TIER_ENGINE, env, signal.SIGKILL)
            started.append((child, f"http://{HOST}:{port}"))
            if sglang:  # it does not say where it lives: the weight sync is told
                self.sglang_engines[started[-1][1]] = plan.engines[i]

        self.engine_start_s = self.timeouts.sglang_s if sglang else self.timeouts.engine_s

        def waits(client: httpx.AsyncClient) -> list[Coroutine[Any, Any, None]]:
            return [
                self._wait_healthy(
                    child, _http_ok(client, url + "/health"), self.engine_start_s, url
                )
                for child, url in started
            ]

        return tuple(url for _, url in started), waits

    def _spawn_router(
        self, engine_urls: Sequence[str]
    ) -> tuple[str, Callable[[httpx.AsyncClient], Coroutine[Any, Any, None]]]:
        """Spawn the router; returns its URL and the wait for its readiness."""
        port = free_port(HOST)
        argv = self._service_argv(
            "router", "--host", HOST, "--port", str(port), "--worker-urls", *engine_urls
        )
        env = self._env(MILLSTREAM_ADMIN_TOKEN=self.cfg.service.admin_token)
        child = self._spawn("router", argv, TIER_ROUTER, env)
        url = f"http://{HOST}:{port}"

        def wait(client: httpx.AsyncClient) -> Coroutine[Any, Any, None]:
            # /readiness: the router is up AND its health round found an engine, so its
            # time includes the engines' start.
            ready = _http_ok(client, url + "/readiness")
            timeout_s = self.timeouts.router_s + self.engine_start_s
            return self._wait_healthy(child, ready, timeout_s, url)

        return url, wait

    async def _start_workers(self, redis) -> None:
        assert self.urls is not None
        env = self._env(REDIS_PASSWORD=self.redis_password)
        keys = RunKeys(self.cfg.run_id)
        common = ["--redis-url", self.urls.redis_url, "--run-id", self.cfg.run_id]
        plan = [
            (
                f"rollout-{i}",
                ["rollout", *common, "--router-url", self.urls.router_url],
                keys.heartbeat("rollout", f"rollout-{i}"),
            )
            for i in range(self.cfg.service.num_rollout_workers)
        ]
        plan += [
            (f"reward-{i}", ["reward", *common], keys.heartbeat("reward", f"reward-{i}"))
            for i in range(self.cfg.service.num_reward_workers)
        ]
        started = []
        for name, (command, *args), heartbeat in plan:
            # A heartbeat left by a previous run's worker of that name must not pass for ours.
            await redis.delete(heartbeat)
            argv = self._service_argv(command, *args, "--consumer-name", name)
            started.append((self._spawn(name, argv, TIER_WORKER, env), heartbeat))
        if self.cfg.reward.reward_executor == "celery":
            for i in range(self.cfg.service.num_reward_workers):
                argv = [
                    sys.executable,
                    "-m",
                    "millstream.cli",
                    "reward-celery",
                    *common,
                    "--log-level",
                    self.cfg.connection.log_level,
                ]
                started.append((self._spawn(f"reward-celery-{i}", argv, TIER_WORKER, env), None))

        def beating(key: str | None, child: Child) -> Callable[[], Awaitable[bool]]:
            async def ready() -> bool:
                if key is None:  # Celery worker: up once it says so
                    return "[reward-celery] run" in child.tail(TAIL_LINES)
                return bool(await redis.exists(key))

            return ready

        await run_all(
            self._wait_healthy(child, beating(key, child), self.timeouts.worker_s, "")
            for child, key in started
        )

    # -- health ---------------------------------------------------------------------------

    async def _wait_healthy(
        self, child: Child, ready: Callable[[], Awaitable[bool]], timeout_s: float, where: str
    ) -> None:
        """Poll `ready()` until true; ServiceExited if the child dies, MillstreamError (with the
        log tail) if it is not healthy in time. Says when it is, and every so often until."""
        self.say(f"starting {child.name} (pid {child.pid}, log {child.log_path})")
        start = time.monotonic()
        next_progress = start + PROGRESS_EVERY_S
        while True:
            code = child.poll()
            if code is not None:
                raise ServiceExited(child, code, "while starting")
            if await ready():
                break
            now = time.monotonic()
            if now - start > timeout_s:
                raise MillstreamError(
                    f"{child.name} was not healthy within {timeout_s:.0f}s; last lines of "
                    f"{child.log_path}:\n{_indent(child.tail(TAIL_LINES))}"
                )
            if now >= next_progress:
                self.say(f"still waiting for {child.name} ({now - start:.0f}s of {timeout_s:.0f}s)")
                next_progress += PROGRESS_EVERY_S
            await asyncio.sleep(HEALTH_POLL_S)
        elapsed = time.monotonic() - start
        at = f" at {redact(where)}" if where else ""
        self.say(f"{child.name} healthy{at} ({elapsed:.1f}s)")


async def run_all(waits: Iterable[Awaitable[Any]]) -> None:
    """Run the waits together; the first failure cancels the rest and is raised as is."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _http_ok(client: httpx.AsyncClient, url: str) -> Callable[[], Awaitable[bool]]:
    async def ready() -> bool:
        try:
            return (await client.get(url)).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


def _conf_quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
