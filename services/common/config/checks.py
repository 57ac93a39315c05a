"""The run's flags checked together, from the flags alone, before anything starts.

Each group checks its own values where it is built (its `__post_init__`), and
`resolve_run_config` the four batch knobs. What is left is checked here, once, in the
trainer's first step (preflight.py calls `check` before it looks at the machine): what the
trainer needs that a worker does not (a model, prompts, a reward, a length), combinations of
groups (parallel sizes against the trainer's ranks, an estimator against the group size),
what this build cannot honour (refusals.py), and names that must be known (--rm-type). No file
is read, no package imported, no service asked: those are preflight's. A problem is a
ConfigError whose message starts with the flag.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from . import RunConfig, refusals
from .errors import ConfigError
from .rollout import is_default_source

# The reward hub's built-ins (reward/rm_hub.py RM_TYPES, BOXED_PREFIX), repeated here since
# the config imports no service; tests/unit/trainer/test_preflight.py holds the copies equal.
RM_TYPES = ("math", "deepscaler", "dapo", "f1", "exact", "remote_rm")
BOXED_PREFIX = "boxed_"


def check(cfg: RunConfig, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError, naming the flag, on the first problem; `environ` gives torchrun's
    WORLD_SIZE (default: this process's environment)."""
    _check_required(cfg)
    refusals.check(cfg)
    _check_parallel(cfg, os.environ if environ is None else environ)
    r = cfg.rollout
    if r.custom_generate_function_path and r.rollout_function_path:
        raise ConfigError(
            "--custom-generate-function-path and --rollout-function-path both replace how a "
            "group is generated: give one"
        )
    _check_group_size(cfg)
    _check_reward(cfg)
    _check_profiling(cfg)
    _check_colocation(cfg, os.environ if environ is None else environ)


def _check_colocation(cfg: RunConfig, environ: Mapping[str, str]) -> None:
    """--colocate shares one device between the trainer and the engines `millstream train`
    starts (docs/gpus.md); the offloads only mean something there."""
    m = cfg.sglang
    if not m.colocate:
        for name, given in (
            ("--offload", m.offload),
            ("--offload-train", m.offload_train),
            ("--offload-rollout", m.offload_rollout),
        ):
            if given:
                raise ConfigError(
                    f"{name} frees memory for engines on the trainer's GPU, which only "
                    "--colocate puts there: add --colocate, or drop it"
                )
        return
    if cfg.service.router_url or cfg.sglang.sglang_router_ip:
        raise ConfigError(
            "--colocate puts the engines `millstream train` starts on the trainer's GPU; "
            "with --router-url (or --sglang-router-ip) the engines run elsewhere: drop one of them"
        )
    ranks = int(environ.get("WORLD_SIZE", "1"))
    if ranks > 1 or cfg.ckpt.train_backend != "torch":
        raise ConfigError(
            "--colocate is built for one trainer rank with the torch backend (one GPU); "
            f"with {ranks} ranks or --train-backend {cfg.ckpt.train_backend} it is not built "
            "yet: drop it and give the engines their own devices"
        )


def _check_required(cfg: RunConfig) -> None:
    """What the trainer needs beyond each group's own validation."""
    if not (cfg.ckpt.hf_checkpoint or cfg.ckpt.ref_load):
        raise ConfigError("--hf-checkpoint (or --ref-load) is required: the starting model")
    r = cfg.rollout
    if r.reads_prompt_data:
        if not r.prompt_data:
            raise ConfigError("--prompt-data is required: a JSONL file of prompts")
    elif is_default_source(r.data_source_path):
        if not (r.custom_generate_function_path or r.rollout_function_path):
            raise ConfigError(
                "--disable-rollout-global-dataset: the trainer admits groups with empty "
                "prompts, so a --custom-generate-function-path or --rollout-function-path must "
                "make them (or give --data-source-path, or drop the flag)"
            )
        if not r.num_rollout:
            raise ConfigError(
                "--disable-rollout-global-dataset needs --num-rollout: without a data set "
                "there are no epochs to count"
            )
    elif not r.num_rollout:
        raise ConfigError(
            f"--data-source-path {r.data_source_path} needs --num-rollout: a data source has "
            "no length to count epochs in"
        )
    if not (cfg.reward.rm_type or cfg.reward.custom_rm_path):
        raise ConfigError("--rm-type or --custom-rm-path is required: how samples are scored")
    if not (cfg.rollout.num_rollout or cfg.rollout.num_epoch):
        raise ConfigError("--num-rollout or --num-epoch is required: how long to train")


def _check_parallel(cfg: RunConfig, environ: Mapping[str, str]) -> None:
    """Recomputation, and the model parallel sizes against the trainer's ranks."""
    m = cfg.megatron
    if m.recompute_granularity == "full" and None in (m.recompute_method, m.recompute_num_layers):
        raise ConfigError(
            "--recompute-granularity full needs --recompute-method (uniform or block) and "
            "--recompute-num-layers, as in Megatron"
        )
    tp = cfg.megatron.tensor_model_parallel_size
    # the trainer's ranks: torchrun's world, or what the flags will ask torchrun for
    ranks = int(environ.get("WORLD_SIZE", "0")) or (
        cfg.megatron.actor_num_nodes * cfg.megatron.actor_num_gpus_per_node
    )
    if tp < 1 or ranks % tp:
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} must divide the trainer's {ranks} rank(s) "
            "(torchrun's, or --actor-num-nodes x --actor-num-gpus-per-node): the ranks of "
            "each tensor parallel group hold one copy of the model between them"
        )
    pp, cp = cfg.megatron.pipeline_model_parallel_size, cfg.megatron.context_parallel_size
    if min(pp, cp) < 1 or ranks % (tp * pp * cp):
        raise ConfigError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
            f"--context-parallel-size {cp} must divide the trainer's {ranks} rank(s): each "
            "such group of ranks holds one copy of the model between them"
        )
    if cfg.megatron.use_distributed_optimizer and tp * pp * cp > 1:
        raise ConfigError(
            "--use-distributed-optimizer with --tensor-model-parallel-size, "
            "--pipeline-model-parallel-size or --context-parallel-size > 1 is not built yet "
            "(the backend sums those ranks' partial gradients itself, outside megatron's "
            "gradient buffers): drop it, and the ranks of each model parallel group keep "
            "optimizer state for their own slices"
        )


def _check_group_size(cfg: RunConfig) -> None:
    a, n = cfg.algo, cfg.rollout.n_samples_per_prompt
    grpo = a.advantage_estimator in ("grpo", "gspo")
    if grpo and n < 2 and not a.disable_grpo_std_normalization:
        raise ConfigError(
            f"--n-samples-per-prompt {n}: {a.advantage_estimator} needs >= 2, "
            "or --disable-grpo-std-normalization"
        )
    if a.advantage_estimator == "reinforce_plus_plus_baseline" and n < 2:
        raise ConfigError(
            f"--n-samples-per-prompt {n}: reinforce_plus_plus_baseline subtracts the group "
            "mean, it needs >= 2"
        )


def _check_reward(cfg: RunConfig) -> None:
    """The reward worker's start-up check (reward/rewarder.py check_reward_config), here."""
    r = cfg.reward
    if r.group_rm and not r.custom_rm_path:
        raise ConfigError("--group-rm scores with your function: set --custom-rm-path too")
    if not r.rm_type:
        return
    name = r.rm_type.strip()
    if name.removeprefix(BOXED_PREFIX) not in RM_TYPES:
        raise ConfigError(
            f"--rm-type {r.rm_type} is not a built-in reward; known: {', '.join(RM_TYPES)} "
            f"(each may take the {BOXED_PREFIX} prefix); for your own reward use "
            "--custom-rm-path pkg.mod.fn"
        )


def _check_profiling(cfg: RunConfig) -> None:
    """A profiler asked for must profile something (the window itself: ProfilingConfig)."""
    p, n = cfg.profiling, cfg.rollout.num_rollout
    if p.enabled and n and p.profile_step_start >= n:
        raise ConfigError(
            f"--profile-step-start {p.profile_step_start}: the run has --num-rollout {n} "
            f"(rollout ids 0 to {n - 1}), so nothing would be profiled"
        )
