"""Validate everything before starting anything: `check(cfg)` runs once in `millstream train`,
after the flags parse and before the first child process (redis-server, engines, router,
workers) starts. A problem is a ConfigError whose message starts with the flag; the CLI
prints it and exits 2, within a second or two and with nothing to stop.

In order, cheapest first:

1. flags alone: common/config/checks.py (what the trainer needs, combinations, refusals,
   --rm-type among the reward hub's built-ins); first, though, the model local engines would
   load (--hf-checkpoint: a --ref-load alone is not served, and a Megatron one is named as
   one, checkpoints/megatron_ckpt.py);
2. this machine: redis-server on PATH when none is given, the packages of the extras the
   processes started here import (found with `importlib.util.find_spec`, never imported:
   torch's import is seconds of CPU and happens later, in a thread, while the engines load),
   and the tracking packages (--tensorboard-dir, --use-tensorboard, --use-wandb: the `track`
   extra) and where --use-tensorboard writes; a CUDA GPU for
   --memory-snapshot-path (torch is imported for that check alone, and only with the flag);
3. the user's code (--custom-rm-path, --rollout-function-path, --buffer-filter-path,
   --dynamic-sampling-filter-path, --rollout-sample-filter-path,
   --custom-generate-function-path), imported with the loader the workers use
   (compat/plugins.py), from the directory they run in, so the rules are theirs (a
   --rollout-function-path in Miles' whole-batch form is refused: compat/miles/); and the
   trainer's own (--custom-rollout-log-function-path,
   --custom-eval-rollout-log-function-path, --data-source-path), loaded as the trainer loads
   them (observe/log_hooks.py), whether or not the workers run here;
4. files: the model dirs (an FP8 --hf-checkpoint is served, and the trainer starts from a
   --ref-load that is never FP8: check_fp8_checkpoints), the MODEL_ARGS given against the
   model's config.json (refusals.check_model), a --load checkpoint that is there (a
   Megatron checkpoint given to --load, --ref-load or a model dir flag is named as one:
   checkpoints/megatron_ckpt.py;
   the Megatron backend reads torch_dist as --load and --ref-load), and the
   prompt data and eval sets, read up to their first usable row with the data source's own row parser.

Left to others: value checks of one group (the config's `__post_init__`); what needs a service
(Redis answering, engines loading the model); the whole data set, which the trainer's build
reads and tokenizes. Workers check their part again at their own start, for deployments where
they run elsewhere; with --redis-url and --router-url both given this process starts no
worker, so steps 2 and 3 skip what only those workers need.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from millstream.common.config import ConfigError, RunConfig, checks, refusals
from millstream.common.config.profiling import MEMORY_SNAPSHOT_NEEDS_CUDA
from millstream.common.config.rollout import is_default_source
from millstream.common.errors import MillstreamError
from millstream.compat.miles import (
    OLD_SIGNATURES,
    check_not_old_signature,
    check_rollout_function,
)
from millstream.compat.plugins import load_function, workers_sys_path
from millstream.launch.plan import given_router_url

from .checkpoints import megatron_ckpt
from .data import ROW_ERRORS, labels_are_text, parse_row
from .observe import log_hooks
from .observe.metrics import TRACK_EXTRA, TRACKING_PACKAGES, tensorboard_dir

# Repeated here, and held equal to the originals by tests/unit/trainer/test_preflight.py: the
# dynamic-sampling filter's built-ins (reward/filters.py BUILTINS), since the trainer imports no
# other service (docs/architecture.md); checkpoints/checkpoint.py's file names, since it imports torch.
BUILTIN_FILTERS = ("check_reward_nonzero_std", "check_no_aborted")
LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"

# What each extra of pyproject.toml provides that a process started here imports.
MODEL_EXTRA = ("torch", "transformers", "safetensors", "tokenizers")
SERVE_EXTRA = ("fastapi", "uvicorn")


def check(cfg: RunConfig) -> None:
    """ConfigError, naming the flag, on the first problem found; see the module docstring."""
    _check_local_engines_model(cfg)
    checks.check(cfg)
    check_machine(cfg)
    check_placement(cfg)
    check_plugins(cfg)
    check_log_functions(cfg)
    check_files(cfg)


def starts_services(cfg: RunConfig) -> bool:
    """This process starts services, workers included (LocalCluster.starts_anything): all
    but a trainer given both --redis-url and --router-url."""
    return not cfg.connection.redis_url or given_router_url(cfg) is None


def _check_local_engines_model(cfg: RunConfig) -> None:
    """Engines started here load --hf-checkpoint, never --ref-load: a run that gives only
    --ref-load needs --router-url (a Miles script's Megatron --ref-load is named as one)."""
    ckpt = cfg.ckpt
    if given_router_url(cfg) is not None or ckpt.hf_checkpoint or not ckpt.ref_load:
        return
    if found := megatron_ckpt.describe(ckpt.ref_load):
        raise ConfigError(megatron_ckpt.message("--ref-load", ckpt.ref_load, found, None))
    raise ConfigError(
        "--hf-checkpoint is required to start local engines (--ref-load is not served); "
        "or pass --router-url to use running ones"
    )


def check_placement(cfg: RunConfig) -> None:
    """The GPU plan fits this machine, and the engines to be started take their --sglang-*
    flags (launch/plan.py, launch/engines.py); nothing to check when none is started here."""
    if given_router_url(cfg) is not None:
        return
    from millstream.launch import engines
    from millstream.launch.plan import gpu_plan, visible_gpus

    try:
        plan = gpu_plan(cfg, visible_gpus())
    except MillstreamError as err:
        raise ConfigError(str(err)) from None
    if plan.engines:
        engines.check(cfg, engines.sglang_installed())


def check_machine(cfg: RunConfig) -> None:
    """Programs and packages the processes started here need, and the tracking packages."""
    if not cfg.connection.redis_url and shutil.which("redis-server") is None:
        raise ConfigError(
            "--redis-url not given and redis-server is not on PATH: install it (Debian: "
            "apt-get install redis-server) or pass --redis-url to use an existing Redis"
        )
    _need(MODEL_EXTRA, "model", f"--train-backend {cfg.ckpt.train_backend} needs")
    if given_router_url(cfg) is None:
        _need(
            SERVE_EXTRA, "serve", "--router-url not given: the engines and router started here need"
        )
    if starts_services(cfg):
        executor = cfg.reward.reward_executor
        package = "celery" if executor == "celery" else "math_verify"
        _need((package,), "reward", f"--reward-executor {executor}: the reward workers need")
    for flag, package in TRACKING_PACKAGES.items():
        if getattr(cfg.logging, flag[2:].replace("-", "_")) and not _installed(package):
            raise ConfigError(
                f"{flag} needs the {package} package, which is not installed: pip install "
                f"'millstream[{TRACK_EXTRA}]' (or pip install {package})"
            )
    tensorboard_dir(cfg)  # --use-tensorboard without a directory: ConfigError
    if cfg.profiling.memory_snapshot_path and not _cuda_available():
        raise ConfigError(MEMORY_SNAPSHOT_NEEDS_CUDA)


def _cuda_available() -> bool:
    import torch  # seconds of CPU: only for --memory-snapshot-path

    return torch.cuda.is_available()


def _need(packages: tuple[str, ...], extra: str, who: str) -> None:
    missing = [p for p in packages if not _installed(p)]
    if missing:
        raise ConfigError(
            f"{who} {', '.join(missing)} (not installed here): pip install 'millstream[{extra}]'"
        )


def _installed(package: str) -> bool:
    """A top-level package is importable; finds it without importing it."""
    return importlib.util.find_spec(package) is not None


def check_plugins(cfg: RunConfig) -> None:
    """The user's functions load, as the workers started here will load them."""
    if not starts_services(cfg):
        return  # the workers run elsewhere, with their own PYTHONPATH
    r = cfg.rollout
    plugins = {
        "--custom-rm-path": cfg.reward.custom_rm_path,
        "--rollout-function-path": r.rollout_function_path,
        "--buffer-filter-path": r.buffer_filter_path,
        "--dynamic-sampling-filter-path": r.dynamic_sampling_filter_path,
        "--rollout-sample-filter-path": r.rollout_sample_filter_path,
        "--custom-generate-function-path": r.custom_generate_function_path,
    }
    # A built-in filter's name, bare or in Miles' or slime's module path, is the reward
    # worker's to resolve (reward/filters.py resolve_filter): no module to import here.
    filter_path = r.dynamic_sampling_filter_path
    if filter_path and filter_path.rsplit(".", 1)[-1] in BUILTIN_FILTERS:
        del plugins["--dynamic-sampling-filter-path"]
    with workers_sys_path():
        for flag, path in plugins.items():
            if not path:
                continue
            try:
                fn = load_function(path, flag)
                if flag == "--rollout-function-path":
                    check_rollout_function(fn, path)  # Miles' whole-batch form: refused
                elif flag in OLD_SIGNATURES:  # written for millstream's old signatures:
                    group = flag == "--custom-rm-path" and cfg.reward.group_rm  # refused
                    check_not_old_signature(fn, flag + (" --group-rm" if group else ""), path)
            except MillstreamError as err:  # the loader's message starts with the flag
                raise ConfigError(str(err)) from None
            except Exception as err:  # the user's module raised while it was imported
                raise ConfigError(
                    f"{flag} {path!r}: importing it raised {type(err).__name__}: {err}"
                ) from None


def check_log_functions(cfg: RunConfig) -> None:
    """The custom log functions, a --data-source-path class and a --custom-tis-function-path
    function load, as the trainer (this process) will load them."""
    trainer_plugins = dict(log_hooks.paths(cfg))
    if not is_default_source(cfg.rollout.data_source_path):
        trainer_plugins["--data-source-path"] = cfg.rollout.data_source_path  # type: ignore[assignment]
    if cfg.algo.use_tis and cfg.algo.custom_tis_function:
        trainer_plugins["--custom-tis-function-path"] = cfg.algo.custom_tis_function
    for flag, path in trainer_plugins.items():
        try:
            if flag in ("--data-source-path", "--custom-tis-function-path"):
                load_function(path, flag)
            else:
                log_hooks.load(flag, path)
        except MillstreamError as err:  # the loader's message starts with the flag
            raise ConfigError(str(err)) from None
        except Exception as err:  # the user's module raised while it was imported
            raise ConfigError(
                f"{flag} {path!r}: importing it raised {type(err).__name__}: {err}"
            ) from None


def check_files(cfg: RunConfig) -> None:
    """Model dirs, a --load checkpoint, the prompt data and the eval sets."""
    ckpt, a = cfg.ckpt, cfg.algo
    for name in ("critic_load", "opd_teacher_load"):  # the models a run adds, named first
        if path := getattr(a, name):
            _model_dir("--" + name.replace("_", "-"), path, ckpt.hf_checkpoint)
    if ckpt.hf_checkpoint:
        _model_dir("--hf-checkpoint", ckpt.hf_checkpoint)
    # --ref-load is read as the reference (a KL term) or as the actor without --hf-checkpoint;
    # a Miles script may pass a Megatron dir there that the torch backend never reads.
    # --train-backend megatron reads a torch_dist --ref-load and --load (megatron/dist.py),
    # with --hf-checkpoint's config.json and tokenizer (check_flags: it is given).
    megatron = ckpt.train_backend == "megatron"
    reads_ref = a.use_kl_loss or a.use_kl_in_reward or not ckpt.hf_checkpoint
    if (
        ckpt.ref_load
        and reads_ref
        and not (megatron and megatron_ckpt.torch_dist_dir(ckpt.ref_load))
    ):
        _model_dir("--ref-load", ckpt.ref_load, ckpt.hf_checkpoint)
    check_fp8_checkpoints(cfg)
    refusals.check_model(cfg)
    if ckpt.load and not (megatron and megatron_ckpt.torch_dist_dir(ckpt.load)):
        _check_load(ckpt.load, ckpt.hf_checkpoint)
    if ckpt.save and os.path.exists(ckpt.save) and not os.path.isdir(ckpt.save):
        raise ConfigError(f"--save {ckpt.save} is a file, not a directory")
    r, e = cfg.rollout, cfg.eval
    if r.reads_prompt_data:
        _check_prompts(
            "--prompt-data", r.prompt_data, r.input_key, r.label_key, r.metadata_key,
            r.tool_key, r.apply_chat_template, r.skip_bad_lines, labels_are_text(cfg),
        )  # fmt: skip
    for name, path in e.datasets().items():
        _check_prompts(
            f"--eval-prompt-data {name}", path, e.eval_input_key or r.input_key,
            e.eval_label_key or r.label_key, e.eval_metadata_key or r.metadata_key, r.tool_key,
            r.apply_chat_template, r.skip_bad_lines, labels_are_text(cfg),
        )  # fmt: skip


def fp8_checkpoint(path: str | None) -> bool:
    """A Hugging Face dir whose config.json says its weights are FP8 (quant_method fp8)."""
    try:
        config = json.loads(Path(path, "config.json").read_text()) if path else {}
    except (OSError, ValueError):
        return False
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quantization, dict) and quantization.get("quant_method") == "fp8"


def check_fp8_checkpoints(cfg: RunConfig) -> None:
    """FP8 rollout is Miles' "BF16 train + FP8 inference" (docs/fp8.md): the engines serve an
    FP8 --hf-checkpoint, and the trainer trains, and anchors its KL term to, the full-precision
    weights of --ref-load (build.py). So an FP8 --hf-checkpoint needs a --ref-load, and
    --ref-load is never FP8: a reference model of FP8-rounded weights is not the actor's start,
    and the KL term would pull towards it without a word."""
    ckpt = cfg.ckpt
    if fp8_checkpoint(ckpt.ref_load):
        raise ConfigError(
            f"--ref-load {ckpt.ref_load} is an FP8 checkpoint (config.json quantization_config "
            "quant_method fp8): the reference model, the KL anchor, would be its FP8-rounded "
            "weights, not the actor's start; give --ref-load the full-precision (bf16/fp32) "
            "checkpoint and --hf-checkpoint the FP8 copy the engines serve"
        )
    if not fp8_checkpoint(ckpt.hf_checkpoint):
        return
    if not ckpt.ref_load:
        raise ConfigError(
            f"--hf-checkpoint {ckpt.hf_checkpoint} is an FP8 checkpoint: the engines serve it, "
            "and the trainer trains full-precision weights, from --ref-load (Miles' BF16 train "
            "+ FP8 rollout); give --ref-load the checkpoint the FP8 copy was made from"
        )
    if not megatron_ckpt.torch_dist_dir(ckpt.ref_load):
        _model_dir("--ref-load", ckpt.ref_load, ckpt.hf_checkpoint)


def _model_dir(flag: str, path: str, hf_checkpoint: str | None = None) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        if found := megatron_ckpt.describe(path):  # a Miles script's Megatron dir
            raise ConfigError(megatron_ckpt.message(flag, path, found, hf_checkpoint))
        what = "does not exist" if not os.path.exists(path) else "has no config.json"
        raise ConfigError(f"{flag} {path} is not a Hugging Face model dir ({what})")


def _check_load(root: str, hf_checkpoint: str | None = None) -> None:
    """A missing --load dir, or one without the latest file, is a fresh start (as in
    checkpoint.latest_iteration); one that names a checkpoint must hold it, in our format
    (a Megatron checkpoint, which a Miles script's --load is, is named as one)."""
    if not os.path.exists(root):
        return
    if not os.path.isdir(root):
        raise ConfigError(f"--load {root} is a file, not a checkpoint directory")
    if found := megatron_ckpt.describe(root):
        raise ConfigError(megatron_ckpt.message("--load", root, found, hf_checkpoint))
    latest = Path(root, LATEST)
    if not latest.is_file():
        return
    text = latest.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"--load {root}: {LATEST} holds {text!r}, not an iteration number")
    state = Path(root, f"iter_{int(text):07d}", STATE)
    if not state.is_file():
        raise ConfigError(f"--load {root}: {LATEST} names iteration {text} but {state} is missing")


def _check_prompts(
    flag: str, path: str | None, input_key: str, label_key: str | None, metadata_key: str,
    tool_key: str | None, chat: bool, skip_bad_lines: bool, text_label: bool,
) -> None:  # fmt: skip
    """Every row parsed as the trainer's data source parses it, without the tokenizer (JSON
    only: about a second per 100k rows): a bad line is an error (unless --skip-bad-lines), and
    so is a file without a usable row."""
    if not path or not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file")
    first_bad, usable = None, 0
    with open(path, encoding="utf-8") as f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    parse_row(line, input_key, label_key, metadata_key, tool_key, chat, text_label)
                    usable += 1
                except ROW_ERRORS as err:
                    # str() of a KeyError is the repr of its message: quotes around it
                    why = err.args[0] if isinstance(err, KeyError) and err.args else err
                    if not skip_bad_lines:
                        raise ConfigError(
                            f"{flag} {path}:{lineno}: {why} (fix the line, or pass --skip-bad-lines)"
                        ) from None
                    first_bad = first_bad or f"the first bad line is {lineno}: {why}"
        except UnicodeDecodeError as err:
            raise ConfigError(f"{flag} {path}: not UTF-8 text ({err})") from None
    if usable:
        return
    if first_bad is None:
        raise ConfigError(f"{flag} {path}: the file has no rows")
    raise ConfigError(f"{flag} {path}: no usable row ({first_bad})")
