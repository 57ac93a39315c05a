"""Flags of Miles, Megatron and SGLang that millstream does not have: why, by family.

A Miles launch script carries more than millstream implements. argparse alone would stop at
the first such flag with "unrecognized arguments", which says neither whose flag it is nor
what to do. `parse_run_config` parses what it knows, then hands every unknown `--flag` here:
`unknown_flags_error` names each with its reason, and the run exits 2 before anything starts.

FAMILIES is matched in order, first match wins: an entry ending in "-" is a prefix
(`--lora-` matches `--lora-rank`), any other entry is one exact flag. A flag of no family is
named as unknown to millstream. The families come from the flags of radixark/miles
(miles/utils/arguments.py) and of the Megatron and SGLang flags its example scripts pass.
"""

from __future__ import annotations

from collections.abc import Sequence

_MEGATRON = (
    "is a Megatron setting millstream does not build (both backends build the model from the "
    "Hugging Face checkpoint's config.json, and --train-backend megatron has no MoE, MTP, "
    "custom model provider or optimizer offload): drop it"
)
_SGLANG = (
    "is not how SGLang's server flags are given here: as in Miles, pass --sglang-X (the "
    "engines `millstream train` starts get --X), without the no- form"
)
_LORA = "is LoRA training, which is not built: millstream trains every parameter; drop it"
_TOOLING = "is Miles' own test and debug tooling, which has no counterpart here: drop it"
_RAY = (
    "places Miles' Ray actors on GPUs; millstream runs its services as processes (or "
    "containers: deploy/compose) and starts no Ray cluster: drop it"
)
_MLFLOW = "is mlflow tracking, which is not built: use --use-wandb or --tensorboard-dir"
_PROMETHEUS = "is Miles' Prometheus exporter: use --metrics-port (every service serves /metrics)"
_OPD_TOPK = (
    "is a variant of Miles' SGLang-teacher distillation (top-k, several teachers) that is not "
    "built: --use-opd with one --opd-teacher-url (or --opd-teacher-load) distils on the "
    "sampled token"
)
_SESSIONS = (
    "is Miles' agent session server, which is not built: write a per-group "
    "--rollout-function-path fn(group, cfg, client) -> SampleGroup (multi-turn: "
    "tests/support/rollout_plugins.py two_turn)"
)

# (flag or prefix, why millstream does not take it), first match wins.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("--no-sglang-", _SGLANG),
    ("--lora-", _LORA),
    ("--multi-lora-", _LORA),
    ("--target-modules", _LORA),
    ("--exclude-modules", _LORA),
    ("--experts-shared-outer-loras", _LORA),
    ("--ci-", _TOOLING),
    ("--debug-", _TOOLING),
    ("--dumper-", _TOOLING),
    ("--check-weight-update-", _TOOLING),
    ("--save-debug-", _TOOLING),
    ("--load-debug-rollout-data", _TOOLING),
    ("--dump-details", _TOOLING),
    ("--enable-witness", _TOOLING),
    ("--witness-buffer-size", _TOOLING),
    ("--memory-recorder", _TOOLING),
    ("--env-report", _TOOLING),
    ("--mlflow-", _MLFLOW),
    ("--use-mlflow", _MLFLOW),
    ("--use-prometheus", _PROMETHEUS),
    ("--prometheus-", _PROMETHEUS),
    ("--custom-megatron-", _MEGATRON),
    ("--custom-model-provider-path", _MEGATRON),
    ("--moe-", _MEGATRON),
    ("--num-experts", _MEGATRON),
    ("--mtp-", _MEGATRON),
    ("--enable-mtp-training", _MEGATRON),
    ("--megatron-to-hf-mode", _MEGATRON),
    ("--optimizer-cpu-offload", _MEGATRON),
    ("--overlap-cpu-optimizer-d2h-h2d", _MEGATRON),
    ("--use-precision-aware-optimizer", _MEGATRON),
    ("--decoder-last-pipeline-num-layers", _MEGATRON),
    ("--decoder-first-pipeline-num-layers", _MEGATRON),
    ("--qkv-format", _MEGATRON),
    ("--allgather-cp", _MEGATRON),
    ("--apply-layernorm-1p", _MEGATRON),
    ("--rotary-percent", _MEGATRON),
    ("--attention-output-gate", _MEGATRON),
    ("--spec", _MEGATRON),
    ("--use-routing-replay", _MEGATRON),
    ("--use-rollout-routing-replay", _MEGATRON),
    ("--no-check-for-nan-in-loss-and-grad", _MEGATRON),
    ("--num-gpus-per-node", _RAY),
    ("--critic-num-nodes", _RAY),
    ("--critic-num-gpus-per-node", _RAY),
    ("--pin-rollout-manager-to-head", _RAY),
    ("--train-env-vars", _RAY),
    (
        "--offload-rollout-level",
        "picks which engine memory --offload-rollout frees; here it is always the KV cache "
        "and the weights: drop it",
    ),
    (
        "--offload-train-",
        "tunes how --offload-train moves the trainer's state; here it moves all of it to "
        "host memory: drop it",
    ),
    (
        "--update-weight-",
        (
            "is a setting of Miles' weight update that millstream does not have (its own: "
            "--update-weight-transport, --update-weight-buffer-size, --weight-sync-*): drop it"
        ),
    ),
    ("--opd-teacher-urls", "is several teachers: give one, --opd-teacher-url URL"),
    ("--opd-", _OPD_TOPK),
    ("--session-", _SESSIONS),
    ("--use-session-server", _SESSIONS),
    ("--tito-model", _SESSIONS),
    (
        "--log-reward-category",
        (
            "logs the share of each category a dict reward names; here a sample's reward is "
            "one number on the wire (a dict reward is read through --reward-key): drop it"
        ),
    ),
    (
        "--loss-type",
        (
            "picks Miles' loss (policy_loss, sft_loss, custom_loss); millstream has the policy "
            "loss only (--advantage-estimator picks GRPO, GSPO, PPO, REINFORCE++, distillation): "
            "drop it"
        ),
    ),
    (
        "--custom-loss-function-path",
        (
            "replaces Miles' Megatron loss, fn(args, batch, logits, sum_of_sample_mean) over its "
            "packed batch; the torch backend has no such seam: drop it"
        ),
    ),
    (
        "--custom-pg-loss-reducer-function-path",
        (
            "replaces Miles' loss reduction; here it is --calculate-per-token-loss (token mean) or "
            "the default (sample mean): drop it"
        ),
    ),
    (
        "--custom-convert-samples-to-train-data-path",
        (
            "builds Miles' Megatron train batch; the trainer here builds its own from the scored "
            "groups: drop it"
        ),
    ),
    (
        "--custom-reward-post-process-path",
        (
            "replaces Miles' reward normalisation; here the advantage estimator normalises "
            "(--disable-grpo-std-normalization, --normalize-advantages): drop it, or score "
            "differently in --custom-rm-path"
        ),
    ),
    (
        "--rollout-all-samples-process-path",
        (
            "sees every sample of Miles' rollout batch, filtered ones too; here groups are "
            "scored one by one: use --custom-rollout-log-function-path (every trained group's "
            "samples) or --dynamic-sampling-filter-path"
        ),
    ),
    (
        "--rollout-data-postprocess-path",
        (
            "mutates Miles' rollout batch after its logprob pass, which the trainer here does not "
            "run as a separate step: drop it"
        ),
    ),
    ("--eval-config", "is Miles' YAML eval config: give --eval-prompt-data NAME PATH pairs"),
)


def is_foreign(name: str) -> bool:
    """`name` (an `args` attribute, `load_debug_rollout_data`) is a flag of FAMILIES: one a run
    that got this far was not given, so it stands at its Miles default."""
    flag = "--" + name.replace("_", "-")
    return any(
        flag == entry or (entry.endswith("-") and flag.startswith(entry)) for entry, _ in FAMILIES
    )


def why_not(flag: str) -> str:
    """Why millstream does not take `flag` (`--x` or `--x=value`)."""
    name = flag.split("=", 1)[0]
    for entry, reason in FAMILIES:
        if name == entry or (entry.endswith("-") and name.startswith(entry)):
            return f"{name} {reason}"
    return (
        f"{name} is not a flag millstream knows (Miles' flags it takes: `millstream train "
        "--help`; examples/miles_compat/README.md says what differs)"
    )


def unknown_flags_error(extras: Sequence[str]) -> str | None:
    """The message for the unknown arguments argparse left over, or None when there are none:
    each unknown flag with its reason; stray values (no flag before them) named as such."""
    flags = [a for a in extras if a.startswith("--")]
    if not flags:
        return f"unrecognized arguments: {' '.join(extras)}" if extras else None
    first, *others = [why_not(f) for f in flags]
    if not others:
        return first
    return first + "".join(f"\n  also: {reason}" for reason in others)
