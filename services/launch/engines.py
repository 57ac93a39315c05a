"""How `millstream train` starts one engine: SGLang's server when SGLang is there, else
millstream's own engine; and where each --sglang-X flag goes.

SGLang is there when $MILLSTREAM_SGLANG_PYTHON names a Python that imports it (SGLang in an
environment of its own: it pins its own torch and transformers), or when `sglang` is importable
beside millstream; the server runs on that Python. A variable, not a --sglang-X flag: those
are SGLang's own, handed on.

    SGLang installed      python -m sglang.launch_server --model-path M --host H --port P
                            --tp-size (--rollout-num-gpus-per-engine) --weight-version V
                            [--device cpu: no GPU planned for it] [--mem-fraction-static F]
                            [--enable-memory-saver: --colocate]
                            then every --sglang-X [value] as --X [value], as Miles hands
                            them to SGLang's ServerArgs (the prefix stripped, the value kept);
                            SGLang's own parser judges them when the server starts
    not installed         millstream engine ... with the --sglang-X it has a setting for
                            (SGLANG_TO_ENGINE); any other is refused by name before anything
                            starts, and so is a --rollout-num-gpus-per-engine above 1

Either way, refused by name before anything starts: a --sglang-X naming a server flag the
launcher sets itself (LAUNCHER_SETS: coming last, it would win, and the server would listen
where the router is not told, or run a TP other than the GPUs the plan gave it; Miles keeps
most of them out of its --sglang-* flags too), and a near miss of one of millstream's own --sglang-* flags
(`--sglang-mem-fraction-statik`: millstream would hand it on, and SGLang would refuse it only
once the server starts). The contract tier (tests/contract/test_server_args.py) parses every
command line built here with the pinned SGLang's `prepare_server_args`, and resolves those of
engines on the CPU with its `resolve_once`, as `sglang.launch_server` does.

Either way the engine is registered with the router (`--worker-urls`), waited for on /health,
and gets the trainer's weights through the coordinator handshake like any other (an SGLang
server says nothing of where it lives, so the sync sends it the update group's route:
weight-sync.md). The GPUs an engine sees come from the placement plan (plan.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

from millstream.common.config import RunConfig
from millstream.common.config.errors import ConfigError
from millstream.common.config.sglang import SERVER_PREFIX, SglangConfig

# SGLang server flag -> millstream engine flag with the same meaning (the value kept).
SGLANG_TO_ENGINE = {
    "--mem-fraction-static": "--mem-fraction-static",
    "--context-length": "--context-length",
    "--log-level": "--log-level",
    "--cuda-graph-max-bs-decode": "--cuda-graph-max-bs",
    # SGLang's older name, as Miles' scripts write it; the pinned SGLang
    # (scripts/sglang-contract.txt) refuses it as ambiguous (-decode, -prefill).
    "--cuda-graph-max-bs": "--cuda-graph-max-bs",
    "--disable-cuda-graph": "--disable-cuda-graph",
    "--max-running-requests": "--max-running-requests",
    "--max-total-tokens": "--max-total-tokens",
    "--dtype": "--dtype",
    "--random-seed": "--seed",
    "--served-model-name": "--served-model-name",
}


# SGLang server flags the launcher sets itself (with SGLang's aliases), and what to do instead.
LISTEN = "drop it: the launcher picks where each engine listens, and tells the router"
LAUNCHER_SETS = {
    "--model-path": "give --hf-checkpoint",
    "--model": "give --hf-checkpoint",
    "--host": LISTEN,
    "--port": LISTEN,
    "--tp-size": "give --rollout-num-gpus-per-engine",
    "--tensor-parallel-size": "give --rollout-num-gpus-per-engine",
    "--weight-version": "drop it: engines start at the trainer's policy version",
    "--device": "give --rollout-num-gpus (0: the engines run on the CPU)",
    "--enable-memory-saver": "give --colocate",
}
# millstream's own --sglang-* flags (parsed, never handed on as they are).
OWN_FLAGS = tuple(
    f.metadata.get("option") or "--" + f.name.replace("_", "-")
    for f in dataclasses.fields(SglangConfig)
    if f.name.startswith("sglang_") and not f.metadata.get("derived")
)
NEAR_MISS = 0.9  # difflib's ratio above which a --sglang-X is taken as a typo of one of ours


SGLANG_PYTHON_ENV = "MILLSTREAM_SGLANG_PYTHON"


def sglang_python() -> str | None:
    """The Python that runs `-m sglang.launch_server` (module docstring), or None: millstream's
    engine. A $MILLSTREAM_SGLANG_PYTHON that cannot import sglang is a ConfigError naming it."""
    other = os.environ.get(SGLANG_PYTHON_ENV)
    if other:
        return _checked_python(other)
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


@functools.cache
def _checked_python(python: str) -> str:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.SubprocessError) as err:
        raise ConfigError(f"${SGLANG_PYTHON_ENV}={python}: cannot run it ({err})") from err
    if found != 0:
        raise ConfigError(
            f"${SGLANG_PYTHON_ENV}={python}: that Python cannot import sglang; name the Python "
            "of the environment SGLang is installed in, or unset it to run millstream's engine"
        )
    return python


def sglang_installed() -> bool:
    """Whether the engines started are SGLang servers (`sglang_python`)."""
    return sglang_python() is not None


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


def _launcher_set(name: str) -> str | None:
    """The flag of LAUNCHER_SETS that --X `name` is, or that argparse would expand it to (an
    unambiguous prefix, as `--tp` for `--tp-size`)."""
    if name in LAUNCHER_SETS:
        return name
    expands = [flag for flag in LAUNCHER_SETS if flag.startswith(name)]
    return expands[0] if len(expands) == 1 else None


def check_handed_on(cfg: RunConfig) -> None:
    """ConfigError naming a --sglang-X no engine may be given (module docstring)."""
    for name, _ in server_flags(cfg):
        given = SERVER_PREFIX + name[2:]
        if (owned := _launcher_set(name)) is not None:
            raise ConfigError(
                f"{given}: the launcher sets SGLang's {owned} itself, and a second one would "
                f"win: {LAUNCHER_SETS[owned]}"
            )
        if near := difflib.get_close_matches(given, OWN_FLAGS, n=1, cutoff=NEAR_MISS):
            raise ConfigError(f"{given}: not a flag; did you mean {near[0]}?")


def check(cfg: RunConfig, sglang: bool) -> None:
    """ConfigError naming what the engines to be started cannot take: a --sglang-X no engine
    may be given (check_handed_on); with SGLang, nothing more (SGLang judges its own flags
    when the server starts); with millstream's engine, a --sglang-X it has no setting for,
    --eval-min-new-tokens, or several GPUs per engine."""
    check_handed_on(cfg)
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
        sglang_python() or sys.executable, "-m", "sglang.launch_server",
        "--model-path", model, "--host", host, "--port", str(port),
        "--tp-size", str(cfg.sglang.rollout_num_gpus_per_engine),
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
