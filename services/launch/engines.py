"""How `millstream train` starts one engine: SGLang's server when `sglang` is importable, else
millstream's own engine; and where each --sglang-X flag goes.

    SGLang installed      python -m sglang.launch_server --model-path M --host H --port P
                            --tp-size (--rollout-num-gpus-per-engine) --weight-version V
                            [--device cpu: no GPU planned for it] [--mem-fraction-static F]
                            [--enable-memory-saver: --colocate]
                            then every --sglang-X [value] as --X [value], as Miles hands
                            them to SGLang's ServerArgs (the prefix stripped, the value kept)
    not installed         millstream engine ... with the --sglang-X it has a setting for
                            (SGLANG_TO_ENGINE); any other is refused by name before anything
                            starts, and so is a --rollout-num-gpus-per-engine above 1

Either way the engine is registered with the router (`--worker-urls`), waited for on /health,
and gets the trainer's weights through the coordinator handshake like any other (an SGLang
server says nothing of where it lives, so the sync sends it the update group's route:
weight-sync.md). The GPUs an engine sees come from the placement plan (plan.py).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

from millstream.common.config import RunConfig
from millstream.common.config.errors import ConfigError
from millstream.common.config.sglang import SERVER_PREFIX

# SGLang server flag -> millstream engine flag with the same meaning (the value kept).
SGLANG_TO_ENGINE = {
    "--mem-fraction-static": "--mem-fraction-static",
    "--context-length": "--context-length",
    "--log-level": "--log-level",
    "--cuda-graph-max-bs": "--cuda-graph-max-bs",
    "--disable-cuda-graph": "--disable-cuda-graph",
    "--max-running-requests": "--max-running-requests",
    "--max-total-tokens": "--max-total-tokens",
    "--dtype": "--dtype",
    "--random-seed": "--seed",
    "--served-model-name": "--served-model-name",
}


def sglang_installed() -> bool:
    """Whether `python -m sglang.launch_server` can start here (the package is importable)."""
    return importlib.util.find_spec("sglang") is not None


def server_flags(cfg: RunConfig) -> list[tuple[str, list[str]]]:
    """The --sglang-X [values] given, as (--X, values) in order."""
    out: list[tuple[str, list[str]]] = []
    for arg in cfg.sglang.sglang_server_args:
        if arg.startswith(SERVER_PREFIX):
            name, eq, value = arg.partition("=")
            out.append(("--" + name[len(SERVER_PREFIX) :], [value] if eq else []))
        else:
            out[-1][1].append(arg)
    return out


def check(cfg: RunConfig, sglang: bool) -> None:
    """ConfigError naming what the engines to be started cannot take: with SGLang, nothing
    (SGLang judges its own flags); with millstream's engine, a --sglang-X it has no setting
    for, --eval-min-new-tokens, or several GPUs per engine."""
    if sglang:
        return
    unknown = [f"{SERVER_PREFIX}{name[2:]}" for name, _ in server_flags(cfg)
               if name not in SGLANG_TO_ENGINE]  # fmt: skip
    if unknown:
        raise ConfigError(
            f"{', '.join(unknown)}: SGLang is not installed here, so the engines started are "
            "millstream's, which have no such setting (they take "
            f"{', '.join(SERVER_PREFIX + k[2:] for k in SGLANG_TO_ENGINE)}): install sglang, "
            "or drop them"
        )
    if cfg.eval.eval_min_new_tokens:
        raise ConfigError(
            f"--eval-min-new-tokens {cfg.eval.eval_min_new_tokens}: SGLang is not installed "
            "here, and millstream's engine has no min_new_tokens (it stops at the first stop "
            "token): install sglang, or drop it"
        )
    per_engine = cfg.sglang.rollout_num_gpus_per_engine
    if per_engine > 1:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {per_engine}: SGLang is not installed here, and "
            "millstream's engine runs on one GPU (no tensor parallelism): install sglang, or "
            "give 1"
        )


@dataclass(frozen=True)
class EngineCommand:
    """One engine's command line, and which server it is ("sglang" or "millstream")."""

    kind: str
    argv: list[str]


def sglang_command(
    cfg: RunConfig,
    model: str,
    host: str,
    port: int,
    weight_version: str,
    fraction: float | None,
    *,
    on_gpu: bool = True,
) -> EngineCommand:
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host,
        "--port", str(port), "--tp-size", str(cfg.sglang.rollout_num_gpus_per_engine),
        "--weight-version", weight_version,
    ]  # fmt: skip
    if not on_gpu:  # the plan gave it no GPU (none here, or --rollout-num-gpus 0)
        argv += ["--device", "cpu"]
    if fraction is not None:
        argv += ["--mem-fraction-static", str(fraction)]
    if cfg.sglang.colocate:  # /release_memory_occupation needs SGLang's memory saver
        argv.append("--enable-memory-saver")
    for name, values in server_flags(cfg):
        argv += [name, *values]
    return EngineCommand("sglang", argv)


def engine_flags(cfg: RunConfig) -> list[str]:
    """The --sglang-X flags millstream's engine has, as its own flags (check() refused the
    rest); they go last, so they win over the launcher's defaults."""
    out: list[str] = []
    for name, values in server_flags(cfg):
        if name in SGLANG_TO_ENGINE:
            out += [SGLANG_TO_ENGINE[name], *values]
    return out
