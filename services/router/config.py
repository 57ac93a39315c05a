"""`millstream router` flags, parsed once into a frozen RouterConfig.

Flag names follow sglang-router where one exists (--worker-urls, --cache-threshold,
--balance-abs-threshold, --balance-rel-threshold, --max-tree-size, --health-*), so a launch
line written for it reads the same here. The admin token may come from the environment
(MILLSTREAM_ADMIN_TOKEN) so it stays out of process listings. --discover-workers and
--discover-interval are millstream's own (DNS discovery, discovery.py).

Imports no torch: this module is loaded by the router process and by tests alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from millstream.common.auth import ADMIN_TOKEN_ENV
from millstream.common.config.errors import ConfigError
from millstream.common.config.schema import add_group, flag, from_namespace
from millstream.common.http_limits import DEFAULT_MAX_REQUEST_BYTES

POLICIES = ("least_inflight", "round_robin", "cache_aware")


def normalize_worker_url(url: str) -> str:
    """`http(s)://host:port` without a trailing slash; ValueError naming the URL otherwise."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker url {url!r} must look like http://host:port")
    if parts.path or parts.query or parts.fragment:
        raise ValueError(f"worker url {url!r} must have no path, query or fragment")
    try:
        parts.port  # noqa: B018 - raises on a non-numeric port
    except ValueError as err:
        raise ValueError(f"worker url {url!r} has a bad port: {err}") from None
    return text


def parse_host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` (a DNS name, an IPv4 address or a bracketed IPv6 one) -> (host, port);
    ValueError naming the text otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r} must look like HOST:PORT (e.g. sglang:30000)")
    if "/" in host or (":" in host and not text.strip().startswith("[")):
        raise ValueError(f"{text!r} must look like HOST:PORT (an IPv6 host in brackets)")
    return host, int(port)


@dataclass(frozen=True)
class RouterConfig:
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(30000, "port to listen on")
    worker_urls: list[str] = flag([], "engines to route to from the start (more via /add_worker)")
    discover_workers: list[str] = flag(
        [],
        "HOST:PORT whose DNS A/AAAA records are workers: each address becomes http://IP:PORT, "
        "added once it answers /health and removed when it no longer resolves (a replicated "
        "service's name, e.g. compose's sglang:30000)",
    )
    discover_interval: float = flag(5.0, "seconds between --discover-workers lookups")
    router_policy: str = flag(
        "least_inflight", "how a worker is chosen for a request", choices=POLICIES
    )
    health_check_interval: float = flag(5.0, "seconds between health-check rounds")
    health_check_timeout: float = flag(5.0, "seconds one worker's health check may take")
    health_failure_threshold: int = flag(
        3, "consecutive failures (checks or refused connections) that take a worker out"
    )
    health_success_threshold: int = flag(
        2, "consecutive passed checks that bring an unhealthy worker back"
    )
    max_retries: int = flag(
        2, "extra attempts on other workers after a refused connection or a 5xx"
    )
    request_timeout: float = flag(
        600.0, "seconds a proxied request may wait for its worker's next bytes (then 504)"
    )
    version_wait_timeout: float = flag(
        30.0,
        "seconds a request waits for a worker while every healthy one is still loading the "
        "expected weight version (a weight sync under way), then 503; 0: 503 at once",
    )
    admin_token: str | None = flag(
        None, f"bearer token required by mutating endpoints (or {ADMIN_TOKEN_ENV})"
    )
    max_request_bytes: int = flag(
        DEFAULT_MAX_REQUEST_BYTES, "largest request body accepted (larger: 413, not read)"
    )
    cache_threshold: float = flag(
        0.3, "cache_aware: prefix match ratio that sends a request to the matching worker"
    )
    balance_abs_threshold: int = flag(
        32, "cache_aware: in-flight spread (max - min) above which load wins over affinity"
    )
    balance_rel_threshold: float = flag(1.5, "cache_aware: ... and max > this x min in-flight")
    max_tree_size: int = flag(
        1_000_000, "cache_aware: prefix blocks remembered before the least recent are evicted"
    )
    log_level: str = flag("info", "", choices=("debug", "info", "warning", "error"))
    run_dir: str | None = flag(None, "traces go to RUN_DIR/traces (unless OTLP is configured)")

    def __post_init__(self) -> None:
        positive = (
            "health_check_interval",
            "health_check_timeout",
            "discover_interval",
            "health_failure_threshold",
            "health_success_threshold",
            "request_timeout",
            "max_tree_size",
            "max_request_bytes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_opt(name)} must be > 0 (got {getattr(self, name)})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535 (got {self.port})")
        if self.version_wait_timeout < 0:
            raise ConfigError(
                f"--version-wait-timeout must be >= 0 (got {self.version_wait_timeout})"
            )
        if self.max_retries < 0:
            raise ConfigError(f"--max-retries must be >= 0 (got {self.max_retries})")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"--cache-threshold must be in [0, 1] (got {self.cache_threshold})")
        if self.balance_abs_threshold < 0:
            raise ConfigError(
                f"--balance-abs-threshold must be >= 0 (got {self.balance_abs_threshold})"
            )
        if self.balance_rel_threshold < 1.0:
            raise ConfigError(
                f"--balance-rel-threshold must be >= 1 (got {self.balance_rel_threshold})"
            )
        if self.admin_token is not None and not self.admin_token.strip():
            raise ConfigError("--admin-token must not be empty")
        urls = []
        for url in self.worker_urls:
            try:
                urls.append(normalize_worker_url(url))
            except ValueError as err:
                raise ConfigError(f"--worker-urls: {err}") from None
        object.__setattr__(self, "worker_urls", list(dict.fromkeys(urls)))
        targets = []
        for text in self.discover_workers:
            try:
                host, port = parse_host_port(text)
            except ValueError as err:
                raise ConfigError(f"--discover-workers: {err}") from None
            targets.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        object.__setattr__(self, "discover_workers", list(dict.fromkeys(targets)))


def _opt(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(prog: str = "millstream router") -> argparse.ArgumentParser:
    # allow_abbrev=False: a partial flag is an error, never silently another flag.
    parser = argparse.ArgumentParser(
        prog=prog,
        description="HTTP router in front of SGLang-API engines (Miles router compatible).",
        allow_abbrev=False,
    )
    add_group(parser, RouterConfig, "router")
    return parser


def parse_router_config(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> RouterConfig:
    """Parse flags (exit 2 with a message on a bad one); the token falls back to the env."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    env = os.environ if environ is None else environ
    try:
        cfg = from_namespace(RouterConfig, ns)
        if cfg.admin_token is None and env.get(ADMIN_TOKEN_ENV):
            cfg = dataclasses.replace(cfg, admin_token=env[ADMIN_TOKEN_ENV])
    except ConfigError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits
    return cfg
