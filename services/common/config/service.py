"""Service flags millstream adds to Miles': where the run lives and how streams behave.

Rollout and reward workers are started with only --redis-url and --run-id (WorkerConfig);
everything else they read from the resolved run config in Redis.

The Redis password, highest precedence first: the one in --redis-url, --redis-password,
the contents of --redis-password-file (which keeps it off the command line and out of
`ps`), the REDIS_PASSWORD environment variable (`redis_conn.connect`). Every service that
connects to Redis takes the same flags; `redis_password` resolves them once, at parse time,
into the config's `redis_password`, which `store.dumps` never writes out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .schema import flag

PASSWORD_FILE_HELP = "file holding the Redis password (keeps it off the command line)"
METRICS_PORT_HELP = (
    "serve Prometheus /metrics on this port, all interfaces (0: a free one, printed at start); "
    "none: no metrics server"
)


def check_metrics_port(port: int | None) -> None:
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port must be in 0..65535 (got {port})")


def read_secret_file(path: str, option: str) -> str:
    """The file's text without its trailing newline; ConfigError naming `option` and the
    path (never the contents) when it cannot be read or is empty."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = getattr(err, "strerror", None) or type(err).__name__
        raise ConfigError(f"{option} {path}: cannot read it ({reason})") from None
    secret = text.rstrip("\r\n")
    if not secret:
        raise ConfigError(f"{option} {path}: the file is empty")
    return secret


def redis_password(password: str | None, password_file: str | None) -> str | None:
    """--redis-password, or the contents of --redis-password-file. Giving both is an error
    unless they agree, so resolving an already resolved config again changes nothing."""
    if password_file is None:
        return password
    from_file = read_secret_file(password_file, "--redis-password-file")
    if password is not None and password != from_file:
        raise ConfigError("give --redis-password or --redis-password-file, not both")
    return from_file


@dataclass(frozen=True)
class ConnectionConfig:
    run_id: str = flag("millstream", "run id: prefix of every Redis key of the run")
    redis_url: str | None = flag(
        None, "Redis URL (redis://[:password@]host:port/db); none: start one"
    )
    redis_password: str | None = flag(
        None, "Redis password, when not in the URL (or REDIS_PASSWORD)"
    )
    redis_password_file: str | None = flag(None, PASSWORD_FILE_HELP)
    log_level: str = flag("info", "", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        if not self.run_id or any(c in self.run_id for c in " :{}"):
            raise ConfigError(
                f"--run-id must be non-empty without spaces, ':' or braces (got {self.run_id!r})"
            )
        password = redis_password(self.redis_password, self.redis_password_file)
        object.__setattr__(self, "redis_password", password)


@dataclass(frozen=True)
class ServiceConfig:
    run_dir: str | None = flag(None, "logs, traces and metrics go here (default runs/RUN_ID)")
    router_url: str | None = flag(None, "an existing router; none: start engines and a router")
    admin_token: str | None = flag(
        None,
        "bearer token sent to the router's and engines' admin endpoints and required by the "
        "Coordinator's JoinEngine (or MILLSTREAM_ADMIN_TOKEN)",
    )
    coordinator_port: int = flag(0, "Coordinator gRPC port on trainer rank 0 (0: pick a free one)")
    metrics_port: int | None = flag(
        None,
        "the trainer's Prometheus /metrics port on rank 0 (0: a free one, printed); none: off. "
        "Workers started here serve none; engines and the router serve /metrics on their port",
    )
    num_rollout_workers: int = flag(1, "rollout workers `millstream train` starts locally")
    num_reward_workers: int = flag(1, "reward workers `millstream train` starts locally")
    max_staleness: int | None = flag(
        None, "train-async: policy versions of work in flight (default 1)"
    )
    max_weight_staleness: int | None = flag(
        None, "drop (and count) samples older than this many versions"
    )
    max_buffer_bytes: int | None = flag(
        None,
        "admission also keeps the wire bytes of the groups admitted and not yet trained (in "
        "Redis and the trainer's buffer) below this many: a group that came back counts its "
        "size, one still out the largest of the last 64 back; never below one batch in "
        "flight. none: bounded by count alone (--max-staleness)",
    )
    claim_idle_ms: int = flag(30_000, "take over a dead consumer's entries after this idle time")
    max_deliveries: int = flag(5, "dead-letter an entry to {run}:dead after this many deliveries")
    stream_block_ms: int = flag(1000, "how long a consumer blocks waiting for entries")
    stall_timeout: float = flag(
        300.0,
        "fail a wait of the trainer when no rollout/reward worker or engine is alive this long",
    )
    trim_interval: float = flag(
        10.0, "seconds between trims of the run's streams and removals of departed consumers"
    )
    max_consecutive_failed_groups: int = flag(
        32,
        "stop the run (exit 1, with the plugin's traceback) after this many groups in a row "
        "failed because a plugin (--custom-rm-path, --custom-generate-function-path, a filter, "
        "...) raised; 0: never stop for that",
    )
    redis_outage_timeout: float = flag(
        120.0,
        "seconds every service keeps reconnecting to a Redis that went away (its work kept) "
        "before it fails",
    )
    lease_ttl: float = flag(
        60.0,
        "one trainer per run: its lease in Redis expires this many seconds after its last "
        "renewal (renewed every third of it); a second trainer may take the run only then",
    )
    lease_held: str = flag(
        "wait",
        "a trainer that finds its run held by another: wait for the lease (an orchestrator's "
        "restart) or exit 5 naming the holder",
        choices=("wait", "exit"),
    )
    num_threads: int = flag(
        0, "the trainer's torch compute threads (0: half the cores when engines run here too)"
    )
    engine_num_threads: int = flag(
        0, "compute threads of each engine started here (0: the cores the trainer leaves)"
    )

    def __post_init__(self) -> None:
        for name in (
            "claim_idle_ms",
            "max_deliveries",
            "num_rollout_workers",
            "num_reward_workers",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})"
                )
        for name in ("num_threads", "engine_num_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})"
                )
        for name in ("stall_timeout", "trim_interval", "redis_outage_timeout", "lease_ttl"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be > 0 (got {getattr(self, name)})"
                )
        if self.max_consecutive_failed_groups < 0:
            raise ConfigError(
                "--max-consecutive-failed-groups must be >= 0 "
                f"(got {self.max_consecutive_failed_groups})"
            )
        if self.admin_token is not None and not self.admin_token.strip():
            raise ConfigError("--admin-token must not be empty")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0 (got {self.max_staleness})")
        if self.max_buffer_bytes is not None and self.max_buffer_bytes <= 0:
            raise ConfigError(
                f"--max-buffer-bytes must be > 0 (got {self.max_buffer_bytes}; leave it out "
                "for no bound)"
            )
        check_metrics_port(self.metrics_port)
