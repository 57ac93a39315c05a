"""Miles' flags in, one frozen, typed RunConfig out, resolved and validated once.

    cfg = parse_run_config(argv, mode="async")   # exits 2 on any bad flag or combination
    cfg.rollout.rollout_batch_size               # every knob filled, never mutated again

Groups (one module each): ckpt + megatron (model.py), rollout, eval, perf, algo (GRPO_ARGS),
optimizer, sglang, reward, logs, and the service flags millstream adds (service.py).
The resolved config travels to workers through Redis (`store.py`) as JSON. Every flag that
names a file or directory is made absolute here, against the trainer's working directory,
before anything reads it: a worker started in another directory (compose, another machine
with the same mounts) reads the same model, data and checkpoints (PATH_FLAGS).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..auth import ADMIN_TOKEN_ENV
from . import custom
from .algo import AlgoConfig
from .errors import ConfigError
from .eval import EvalConfig
from .foreign import unknown_flags_error
from .logs import LoggingConfig
from .model import CkptConfig, MegatronConfig
from .optimizer import OptimizerConfig
from .perf import PerfConfig
from .profiling import ProfilingConfig
from .reward import RewardConfig
from .rollout import RolloutConfig, resolve_batch_knobs
from .schema import add_group, from_namespace
from .service import ConnectionConfig, ServiceConfig
from .sglang import SglangConfig, server_arg, split_server_args

__all__ = ["ConfigError", "RunConfig", "build_parser", "parse_run_config", "resolve_run_config"]

MODES = ("sync", "async")


@dataclass(frozen=True)
class RunConfig:
    mode: str
    connection: ConnectionConfig
    service: ServiceConfig
    ckpt: CkptConfig
    megatron: MegatronConfig
    rollout: RolloutConfig
    eval: EvalConfig
    perf: PerfConfig
    algo: AlgoConfig
    optimizer: OptimizerConfig
    sglang: SglangConfig
    reward: RewardConfig
    logging: LoggingConfig
    profiling: ProfilingConfig

    @property
    def run_id(self) -> str:
        return self.connection.run_id

    @property
    def run_dir(self) -> str:
        return self.service.run_dir or f"runs/{self.connection.run_id}"

    @property
    def max_staleness(self) -> int:
        """Versions of work admission keeps in flight: 0 in sync mode (strictly on-policy)."""
        return self.service.max_staleness or 0


# (field of RunConfig, group class, title in --help)
GROUPS: tuple[tuple[str, type, str], ...] = (
    ("connection", ConnectionConfig, "run and connection"),
    ("service", ServiceConfig, "millstream services"),
    ("ckpt", CkptConfig, "model and checkpoints (CKPT_ARGS)"),
    ("rollout", RolloutConfig, "rollout (ROLLOUT_ARGS)"),
    ("eval", EvalConfig, "eval (EVAL_ARGS)"),
    ("reward", RewardConfig, "reward"),
    ("perf", PerfConfig, "performance (PERF_ARGS)"),
    ("algo", AlgoConfig, "algorithm (GRPO_ARGS)"),
    ("optimizer", OptimizerConfig, "optimizer (OPTIMIZER_ARGS)"),
    ("sglang", SglangConfig, "inference engines (SGLANG_ARGS)"),
    ("logging", LoggingConfig, "logging"),
    ("profiling", ProfilingConfig, "profiling (Miles' and Megatron's profiler flags)"),
    (
        "megatron",
        MegatronConfig,
        "Megatron model and parallelism (MODEL_ARGS: checked against the HF checkpoint; the "
        "Megatron-only ones exit 2 unless left at their defaults)",
    ),
)


def build_parser(prog: str, description: str = "") -> argparse.ArgumentParser:
    # allow_abbrev=False: a typo'd or partial flag is an error, never silently another flag.
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        usage="%(prog)s [FLAGS...]   (`%(prog)s --help` lists every flag by group)",
    )
    for _, cls, title in GROUPS:
        add_group(parser, cls, title)
    return parser


def resolve_run_config(ns: argparse.Namespace, mode: str) -> RunConfig:
    """Typed groups from parsed flags, with the derived values filled in; ConfigError if invalid."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES} (got {mode!r})")
    groups = {name: from_namespace(cls, ns) for name, cls, _ in GROUPS}

    r = groups["rollout"]
    rbs, n, gbs, steps = resolve_batch_knobs(
        r.rollout_batch_size, r.n_samples_per_prompt, r.global_batch_size, r.num_steps_per_rollout
    )
    groups["rollout"] = dataclasses.replace(
        r,
        rollout_batch_size=rbs,
        n_samples_per_prompt=n,
        global_batch_size=gbs,
        num_steps_per_rollout=steps,
    )

    s = groups["service"]
    if mode == "sync":
        if s.max_staleness:
            raise ConfigError(
                f"--max-staleness {s.max_staleness} asks for async training: use `millstream train-async`"
            )
        groups["service"] = dataclasses.replace(s, max_staleness=0)
    else:
        if s.max_staleness == 0:
            raise ConfigError("train-async needs --max-staleness >= 1 (0 is `millstream train`)")
        groups["service"] = dataclasses.replace(s, max_staleness=s.max_staleness or 1)

    context, e = groups["rollout"].rollout_max_context_len, groups["eval"]
    if context is not None:
        if e.eval_max_prompt_len is None:
            groups["eval"] = dataclasses.replace(e, eval_max_prompt_len=context - 1)
        elif e.eval_max_prompt_len >= context:
            raise ConfigError(
                f"--eval-max-prompt-len ({e.eval_max_prompt_len}) must be below "
                f"--rollout-max-context-len ({context}), so that a kept prompt leaves room "
                "for at least one generated token"
            )

    if groups["perf"].micro_batch_size > gbs:
        raise ConfigError(
            f"--micro-batch-size ({groups['perf'].micro_batch_size}) must be <= --global-batch-size ({gbs})"
        )
    return RunConfig(mode=mode, **_absolute_paths(groups))


# The fields that name a file or directory, by group (eval's --eval-prompt-data: every PATH of
# its NAME PATH pairs). Plugin flags are module paths (pkg.mod.fn) and stay as given, as do
# URLs; the run dir's default, runs/RUN_ID, is resolved too.
PATH_FLAGS: dict[str, tuple[str, ...]] = {
    "ckpt": ("hf_checkpoint", "ref_load", "load", "save"),
    "algo": ("critic_load", "opd_teacher_load"),
    "rollout": ("prompt_data", "chat_template_path", "custom_config_path"),
    "service": ("run_dir",),
    "connection": ("redis_password_file",),
    "logging": ("tensorboard_dir", "wandb_dir"),
    "profiling": ("memory_snapshot_path",),
    "sglang": ("update_weight_disk_dir",),
}


def _absolute(path: str | None) -> str | None:
    if not path or "://" in path or path.startswith("base64:"):
        return path
    return os.path.abspath(path)


def _absolute_paths(groups: dict[str, Any]) -> dict[str, Any]:
    """`groups` with every PATH_FLAGS value absolute (relative to the working directory)."""
    out = dict(groups)
    for name, fields in PATH_FLAGS.items():
        out[name] = dataclasses.replace(
            out[name], **{f: _absolute(getattr(out[name], f)) for f in fields}
        )
    s, run_id = out["service"], out["connection"].run_id
    out["service"] = dataclasses.replace(s, run_dir=s.run_dir or _absolute(f"runs/{run_id}"))
    pairs = out["eval"].eval_prompt_data
    if pairs:
        resolved = [p if i % 2 == 0 else _absolute(p) for i, p in enumerate(pairs)]
        out["eval"] = dataclasses.replace(out["eval"], eval_prompt_data=resolved)
    return out


def parse_run_config(
    argv: Sequence[str],
    *,
    mode: str = "sync",
    prog: str = "millstream train",
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Parse a Miles-style command line; on any error print it and exit with status 2.
    Without --admin-token, the token is MILLSTREAM_ADMIN_TOKEN's, as for router and engines."""
    parser = build_parser(prog)
    ns, extras = parser.parse_known_args(list(argv))
    # SGLang's own server flags, as Miles takes them: --sglang-X, handed on (launch/engines.py)
    ns.sglang_server_args, extras = split_server_args(extras)
    if message := unknown_flags_error(extras):  # a Miles, Megatron or SGLang flag: say why
        parser.error(message)
    env = os.environ if environ is None else environ
    if not hasattr(ns, "admin_token") and env.get(ADMIN_TOKEN_ENV):
        ns.admin_token = env[ADMIN_TOKEN_ENV]
    try:
        if (dp := server_arg(ns.sglang_server_args, "dp-size")) is not None:
            ns.sglang_dp_size = _int("--sglang-dp-size", dp)
        custom.apply(ns, GROUPS)
        return resolve_run_config(ns, mode)
    except ConfigError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def _int(option: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{option} takes an integer (got {text!r})") from None
