"""What a rollout worker is told, and what it derives per group from the run config.

A worker starts with only where the run lives (`--redis-url`, `--run-id`,
docs/architecture.md); every rollout knob comes from the run config the trainer published at `{run}:config`.
`--router-url` overrides the config's `service.router_url` (a worker in another network).

Per group the worker needs a `GroupPlan`: how many samples and the SGLang sampling params.
Eval groups take the `--eval-*` overrides, each inheriting the rollout value when unset, and
`--n-samples-per-eval-prompt`; a group that names its own `n_samples` wins over both.

Seeds: every request carries a `sampling_seed` derived from `--rollout-seed`, the group's
place in the data (data_index, epoch, eval name), the sample index, and how many tokens the
sample already has (a resumed sample must not replay the random stream of its first part).
So a rerun under the same weights samples the same tokens, the n samples of a group differ,
and no two epochs repeat. Group ids are not part of it: they need not be stable across runs.

Plugins (`--rollout-function-path`, `--buffer-filter-path`) are loaded only from the run
config, never from a stream entry, so a message on the wire cannot make a worker import code.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from millstream.common.config import RunConfig
from millstream.common.config.errors import ConfigError
from millstream.common.config.schema import add_group, flag, from_namespace
from millstream.common.config.service import (
    METRICS_PORT_HELP,
    PASSWORD_FILE_HELP,
    check_metrics_port,
    redis_password,
)
from millstream.common.errors import MillstreamError
from millstream.common.types import PromptGroup

SEED_MODULUS = 2**31
"""Seeds stay below 2**31 so any engine's seed type holds them."""


@dataclass(frozen=True)
class WorkerArgs:
    redis_url: str | None = flag(None, "Redis URL of the run (redis://[:password@]host:port/db)")
    run_id: str | None = flag(None, "run id: the worker reads {run}:config and {run}:prompts")
    redis_password: str | None = flag(
        None, "Redis password, when not in the URL (or REDIS_PASSWORD)"
    )
    redis_password_file: str | None = flag(None, PASSWORD_FILE_HELP)
    router_url: str | None = flag(None, "router to generate through (default: the run config's)")
    consumer_name: str | None = flag(None, "Redis consumer name (default: rollout-HOST-PID)")
    log_level: str = flag("info", "", choices=("debug", "info", "warning", "error"))
    run_dir: str | None = flag(None, "traces go to RUN_DIR/traces (default: the run config's)")
    metrics_port: int | None = flag(None, METRICS_PORT_HELP)

    def __post_init__(self) -> None:
        if not self.redis_url:
            raise ConfigError("--redis-url is required (the run's Redis)")
        if not self.run_id:
            raise ConfigError("--run-id is required (the trainer's --run-id)")
        check_metrics_port(self.metrics_port)
        password = redis_password(self.redis_password, self.redis_password_file)
        object.__setattr__(self, "redis_password", password)


def build_parser(prog: str = "millstream rollout") -> argparse.ArgumentParser:
    # allow_abbrev=False: a partial flag is an error, never silently another flag.
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Rollout worker: {run}:prompts -> router -> {run}:generated. Every rollout "
        "knob comes from the run config the trainer publishes.",
        allow_abbrev=False,
    )
    add_group(parser, WorkerArgs, "rollout worker")
    return parser


def parse_worker_args(argv: Sequence[str]) -> WorkerArgs:
    """Parse flags; exit 2 with a message naming the flag on a bad one."""
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    try:
        return from_namespace(WorkerArgs, ns)
    except ConfigError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def router_url_for(args: WorkerArgs, cfg: RunConfig) -> str:
    url = args.router_url or cfg.service.router_url
    if not url:
        raise MillstreamError(
            f"run {cfg.run_id!r} has no router URL in its config (service.router_url): pass "
            "--router-url to the rollout worker, or --router-url to the trainer"
        )
    return url.rstrip("/")


@dataclass(frozen=True)
class GroupPlan:
    """How one group is generated: `n_samples` requests with these sampling params."""

    n_samples: int
    sampling_params: dict[str, Any]
    seed_key: str

    @property
    def max_new_tokens(self) -> int:
        return int(self.sampling_params["max_new_tokens"])


def _pick(override: Any, inherited: Any) -> Any:
    return inherited if override is None else override


def plan_for(group: PromptGroup, cfg: RunConfig) -> GroupPlan:
    """The group's sample count and SGLang sampling params (eval overrides for eval groups)."""
    r, e = cfg.rollout, cfg.eval
    temperature, top_p, top_k = r.rollout_temperature, r.rollout_top_p, r.rollout_top_k
    max_new_tokens = r.rollout_max_response_len
    n_default = r.n_samples_per_prompt or 1
    if group.is_eval:
        temperature = _pick(e.eval_temperature, temperature)
        top_p = _pick(e.eval_top_p, top_p)
        top_k = _pick(e.eval_top_k, top_k)
        max_new_tokens = _pick(e.eval_max_response_len, max_new_tokens)
        n_default = e.n_samples_per_eval_prompt
    if r.rollout_max_context_len is not None:  # what the prompt leaves (0: nothing, truncated)
        room = r.rollout_max_context_len - len(group.prompt_token_ids)
        max_new_tokens = max(0, min(max_new_tokens, room))
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": r.rollout_min_p,
        "skip_special_tokens": r.rollout_skip_special_tokens,
        # The trainer needs every generated token, stop string included, to match the text.
        "no_stop_trim": True,
    }
    if r.rollout_stop:
        params["stop"] = list(r.rollout_stop)
    if r.rollout_stop_token_ids:
        params["stop_token_ids"] = list(r.rollout_stop_token_ids)
    if group.is_eval and e.eval_min_new_tokens:
        params["min_new_tokens"] = e.eval_min_new_tokens
    eval_part = f"eval={group.eval_name}" if group.is_eval else "train"
    seed_key = f"{r.rollout_seed}:{eval_part}:{group.data_index}:{group.epoch}"
    return GroupPlan(group.n_samples or n_default, params, seed_key)


def derive_seed(seed_key: str, sample_index: int, tokens_done: int = 0) -> int:
    """A stable per-request seed (see the module docstring); blake2b, so not Python's hash()."""
    text = f"{seed_key}:{sample_index}:{tokens_done}".encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_MODULUS
