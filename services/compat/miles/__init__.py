"""Miles' public plugin surface, for every service that runs plugins: `args`, `Sample`, the hooks.

A plugin written for Miles (radixark/miles) runs here unchanged where the hook means the same
thing in a disaggregated system, imports included. Each worker builds one `args` from the
resolved RunConfig (`make_args`) and converts its wire messages (protobuf, common/types.py) to
Miles' `Sample` at the edge, in this module only (`sample_from_pb`, `sample_to_pb`,
`groups_from_pb`).

Hooks (flag -> what is called -> where; the call sites name the flag and path on errors):

* `--custom-rm-path`: `fn(args, sample) -> float | dict`, or with `--group-rm`
  `fn(args, samples) -> list`; sync or async (Miles awaits it; a sync one runs in a thread).
  Reward worker (reward/rewarder.py), per sample / per group, as in Miles.
* `--dynamic-sampling-filter-path`: `fn(args, samples, **kwargs) -> DynamicFilterOutput`
  (a bare bool is read as `keep`, like Miles' call_dynamic_filter); sync or async. Reward
  worker, per scored training group (reward/filters.py), as in Miles.
* `--buffer-filter-path`: `fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]`,
  called with `rollout_id=None` (as Miles does) and `num_samples=len(buffer)`. The difference:
  Miles' buffer holds groups left over for a later rollout; ours holds the groups whose
  samples a weight sync aborted (--partial-rollout), and what the function returns is the
  order they resume in (rollout/partial.py). A group it leaves out is not dropped (every
  admitted group ends in exactly one terminal state): it resumes after the chosen ones.
* `--rollout-function-path`: Miles' `generate_rollout(args, rollout_id, data_source,
  evaluation=False)` drives a whole rollout batch from the data source; here the trainer
  admits groups and each rollout worker serves one group at a time, so that form is refused
  (preflight, exit 2). What to write instead: the per-group millstream form
  `fn(group: PromptGroup, cfg, client) -> SampleGroup` (rollout/worker.py).
* `--data-source-path`: Miles' `DataSource` class, `cls(args)` with `get_samples(n) ->
  list[list[Sample]]`, `save(rollout_id)`, `load(rollout_id)`. Trainer, in admission: each
  group's first Sample gives the prompt, label and metadata (trainer/data.py
  PluginDataSource); `add_samples` is not called (see `DataSource`).
* `--rollout-sample-filter-path`: Miles' per-sample loss filter `fn(args, data) -> None`,
  setting `sample.remove_sample`. Miles calls it once per rollout batch; here the reward
  worker calls it per kept training group, `fn(args, [group])`, and a removed sample goes to
  the trainer with an all-zero loss mask (reward/filters.py).
* `--custom-rollout-log-function-path` / `--custom-eval-rollout-log-function-path`: Miles'
  log functions, with this `args` and these Samples (trainer/observe/log_hooks.py).
* `--custom-generate-function-path`: Miles' per-sample `async generate(args, sample,
  sampling_params) -> Sample`, reaching the engines through the router at
  `args.sglang_router_ip`/`args.sglang_router_port`. Rollout worker, for each sample of a
  group at once (rollout/miles_generate.py).
* `--eval-function-path` is refused in preflight (common/config/refusals.py), saying what to use
  instead.

`Sample` is Miles' (types.py): every field and method, Miles' `Sample.Status` values.
From the wire message: `index` is the sample's index inside its group (0 .. n-1; Miles numbers
samples globally), `group_index` is the prompt's position in the data source when known,
`weight_versions` has one entry per response token (Miles: one per generate call), `reward` is
None before scoring, `label` is the data row's label as Miles hands it over (the JSON value of
`label_json` when the row held a dict, list, number or bool, else the `label` text), and
millstream adds `group_id`, `finish_reason` and `failure_reason`. Fields with no wire
counterpart (multimodal inputs, `remove_sample`, teacher logprobs, ...) are not carried back.

Miles' imports: every plugin loader (compat/plugins.py) first installs an import hook for
Miles' module names when Miles itself is not installed (importer.py `install_miles_modules`),
so Miles' modules below are the modules of this package, the same objects:

| Miles' module | here | what |
| --- | --- | --- |
| miles.utils.types | types.py | Sample, RewardSpec, AdapterRef, MultimodalTypes |
| miles.utils.http_utils | http_utils.py | post (with retries), get, wait_http_ok, port helpers |
| miles.utils.misc | misc.py | load_function, SingletonMeta, get_free_port, ... |
| miles.utils.async_utils | async_utils.py | run (a background event loop) |
| miles.utils.data | data.py | Dataset (JSONL/Parquet prompt rows as Samples) |
| miles.utils.iter_utils | iter_utils.py | group_by, chunk_named_params_by_size |
| miles.utils.processing_utils | processing_utils.py | load_tokenizer, load_processor, images |
| miles.utils.mask_utils | mask_utils.py | MultiTurnLossMaskGenerator |
| miles.rollout.base_types | base_types.py | RolloutFn*/GenerateFn* inputs and outputs |
| miles.rollout.data_source | data_source.py | DataSource, RolloutDataSource(WithBuffer) |
| miles.rollout.filter_hub.base_types | filter_hub.py | DynamicFilterOutput, MetricGatherer |
| miles.rollout.filter_hub.dynamic_sampling_filters | filter_hub.py | the two filters |
| miles.rollout.sglang_rollout | sglang_rollout.py | GenerateState, generate, generate_and_rm |
| miles.rollout.rm_hub(.*) | rm_hub/ | async_rm, batched_async_rm and Miles' graders |
| miles.backends.training_utils.cp_utils | cp_utils.py | all_gather_with_cp, ... (one CP rank) |

Any other Miles module raises ModuleNotFoundError naming it and why (importer.py REFUSED:
Ray, Megatron internals, launch tooling, LoRA, whole-batch rollout drivers, ...).

Loads without torch: each stand-in imports transformers and the like when first used.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Iterable, Sequence
from typing import Any

from millstream.common.config import GROUPS, RunConfig, foreign
from millstream.common.errors import MillstreamError
from millstream.common.types import PromptGroup, SampleGroup, SampleStatus
from millstream.common.types import Sample as PbSample

from .data_source import DataSource
from .filter_hub import DynamicFilterOutput
from .http_utils import post as http_post
from .importer import MILES_MODULES, install_miles_modules
from .types import AdapterRef, RewardSpec, Sample

__all__ = [
    "MILES_MODULES",
    "AdapterRef",
    "Args",
    "DataSource",
    "DynamicFilterOutput",
    "PluginSignatureError",
    "RewardSpec",
    "Sample",
    "check_not_old_signature",
    "check_rollout_function",
    "groups_from_pb",
    "http_post",
    "install_miles_modules",
    "is_async",
    "label_from_pb",
    "make_args",
    "miles_samples",
    "named_error",
    "sample_from_pb",
    "sample_to_pb",
    "samples_from_pb",
]


class PluginSignatureError(MillstreamError):
    """A plugin written for a Miles hook that cannot mean the same thing here."""


# Miles flags millstream refuses whose Miles default is not "off" but what millstream does
# anyway, by attribute. qkv_format: a loss or TIS function is handed each sample's response
# unpadded, one after another (Miles' "thd"; mis.py passes args.qkv_format to cp_utils).
FOREIGN_DEFAULTS: dict[str, Any] = {"qkv_format": "thd"}


class Args:
    """Miles' `args`: every flag of the run by its Miles name (`args.rollout_batch_size`),
    read-only. Built from the resolved RunConfig: the fields of all its groups, plus `mode`.
    Setting or deleting an attribute raises AttributeError; an SGLang server flag handed on as
    given (`--sglang-X v`, config/sglang.py) reads its value (True for a bare flag), None when
    not given; a Miles flag millstream refuses (config/foreign.py) reads None, as off as its
    Miles default, or that default where millstream does what it says (FOREIGN_DEFAULTS); any
    other name that is no flag here raises AttributeError naming it, so
    `getattr(args, name, default)` works as it does on Miles'."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            if name.startswith("sglang_"):
                return _server_arg(values.get("sglang_server_args") or (), name)
            if name in FOREIGN_DEFAULTS:
                return FOREIGN_DEFAULTS[name]
            if foreign.is_foreign(name):
                # A Miles flag millstream refuses (config/foreign.py), so never given to a run
                # that gets here: off, as Miles' default is (`if args.load_debug_rollout_data:`
                # in Miles' default log function).
                return None
            raise AttributeError(f"args has no attribute {name!r}: no such flag here") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"args is read-only (setting args.{name}): the run config is resolved once and "
            "shared by every worker; keep your own state in your module or in sample.metadata"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"args is read-only (deleting args.{name})")

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def __dir__(self) -> list[str]:
        return sorted(self._values)

    def __repr__(self) -> str:
        return f"Args({len(self._values)} flags, mode={self._values.get('mode')!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Args, (self._values,))

    def to_dict(self) -> dict[str, Any]:
        """A copy of the values, by flag name."""
        return dict(self._values)


def _server_arg(server_args: Sequence[str], name: str) -> Any:
    """The value of `--<name with dashes>` among the SGLang server flags as given (`--x v`,
    `--x=v`, several values: a list, none: True), or None."""
    flag = "--" + name.replace("_", "-")
    for i, arg in enumerate(server_args):
        key, eq, inline = arg.partition("=")
        if key != flag:
            continue
        if eq:
            return inline
        values = []
        for value in server_args[i + 1 :]:
            if value.startswith("--"):
                break
            values.append(value)
        return True if not values else values[0] if len(values) == 1 else values
    return None


def make_args(cfg: RunConfig) -> Args:
    """The `args` Miles' plugins receive, for this run config (lists become tuples)."""
    values: dict[str, Any] = {"mode": cfg.mode}
    for group_name, cls, _ in GROUPS:
        group = getattr(cfg, group_name)
        for f in dataclasses.fields(cls):
            if f.name in values:
                raise ValueError(f"flag {f.name!r} is in two config groups")
            value = getattr(group, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    # --custom-config-path's keys that no flag took (common/config/custom.py), over the rest
    # as Miles' setattr puts them: mis.yaml's tis_mode is its function's, not --tis-mode.
    values.update(cfg.rollout.custom_config)
    return Args(values)


_STATUS_FROM_PB = {
    SampleStatus.SAMPLE_STATUS_UNSPECIFIED: Sample.Status.PENDING,
    SampleStatus.SAMPLE_STATUS_COMPLETED: Sample.Status.COMPLETED,
    SampleStatus.SAMPLE_STATUS_TRUNCATED: Sample.Status.TRUNCATED,
    SampleStatus.SAMPLE_STATUS_ABORTED: Sample.Status.ABORTED,
    SampleStatus.SAMPLE_STATUS_FAILED: Sample.Status.FAILED,
}
_STATUS_TO_PB = {v: k for k, v in _STATUS_FROM_PB.items()}


def _metadata(text: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"metadata_json": text}  # not JSON: kept as it came, never dropped
    return value if isinstance(value, dict) else {"metadata_json": value}


def label_from_pb(label: str, label_json: str) -> Any:
    """The label a plugin sees: the JSON value when the wire carries one, else the text."""
    return json.loads(label_json) if label_json else label


def _label_to_pb(label: Any) -> tuple[str, str]:
    """(label, label_json) on the wire: text as it is; any other value as JSON in both."""
    if label is None:
        return "", ""
    if isinstance(label, str):
        return label, ""
    text = json.dumps(label)
    return text, text


def _group_label_json(pb: PbSample, label_json: str) -> str:
    """The group's label JSON for a wire sample that kept the group's label (its text, or
    none) but not its JSON."""
    return label_json if pb.label in ("", label_json) else ""


def sample_from_pb(
    pb: PbSample,
    *,
    prompt: str | list[dict[str, str]] = "",
    group_index: int | None = None,
    scored: bool = False,
    label_json: str = "",
) -> Sample:
    """Miles' Sample for the wire `pb`. `prompt`: the group's prompt text (the wire sample has
    none); `scored`: the reward on the wire is real (after the reward stage), else None;
    `label_json`: the group's, for a wire sample that carries no JSON of its own."""
    response = list(pb.response_token_ids)
    return Sample(
        group_index=group_index,
        index=pb.index,
        prompt=prompt,
        tokens=list(pb.prompt_token_ids) + response,
        response=pb.response_text,
        response_length=len(response),
        label=label_from_pb(pb.label, pb.label_json or _group_label_json(pb, label_json)),
        reward=pb.reward if scored else None,
        loss_mask=list(pb.loss_mask) if len(pb.loss_mask) else None,
        weight_versions=[str(v) for v in pb.weight_versions],
        rollout_log_probs=list(pb.rollout_logprobs) if len(pb.rollout_logprobs) else None,
        status=_STATUS_FROM_PB.get(pb.status, Sample.Status.PENDING),
        metadata=_metadata(pb.metadata_json),
        group_id=pb.group_id,
        finish_reason=pb.finish_reason,
        failure_reason=pb.failure_reason,
    )


def sample_to_pb(sample: Sample) -> PbSample:
    """The wire Sample for Miles' `sample` (the inverse of `sample_from_pb`). A dict reward is
    not a wire value: read it with --reward-key first."""
    if isinstance(sample.reward, dict):
        raise TypeError("sample.reward is a dict; the wire carries one number (--reward-key)")
    n = sample.response_length
    if not 0 <= n <= len(sample.tokens):
        raise ValueError(f"response_length {n} does not fit in {len(sample.tokens)} tokens")
    for name in ("loss_mask", "rollout_log_probs"):  # one per response token, as Miles' are
        value = getattr(sample, name)
        if value is not None and len(value) != n:
            raise ValueError(f"sample.{name} has {len(value)} entries for {n} response tokens")
    meta = sample.metadata
    label, label_json = _label_to_pb(sample.label)
    return PbSample(
        group_id=sample.group_id,
        index=sample.index or 0,
        prompt_token_ids=sample.prompt_tokens,
        response_token_ids=sample.response_tokens,
        response_text=sample.response,
        label=label,
        label_json=label_json,
        loss_mask=sample.loss_mask or [],
        rollout_logprobs=sample.rollout_log_probs or [],
        weight_versions=[int(v) for v in sample.weight_versions],
        status=_STATUS_TO_PB[sample.status],
        reward=float(sample.reward) if sample.reward is not None else 0.0,
        metadata_json=json.dumps(meta) if meta else "",
        failure_reason=sample.failure_reason,
        finish_reason=sample.finish_reason,
    )


def samples_from_pb(
    pbs: Iterable[PbSample], prompt: str = "", *, scored: bool = False, label_json: str = ""
) -> list[Sample]:
    """`sample_from_pb` of each; `label_json`: the group's (PromptGroup.label_json)."""
    return [sample_from_pb(s, prompt=prompt, scored=scored, label_json=label_json) for s in pbs]


def miles_samples(group: SampleGroup) -> list[Sample]:
    """Miles' Samples of a scored wire group: its prompt text, data index and rewards."""
    p = group.prompt
    return [
        sample_from_pb(
            s, prompt=p.prompt_text, group_index=p.data_index, scored=True, label_json=p.label_json
        )
        for s in group.samples
    ]


def groups_from_pb(groups: Sequence[PromptGroup]) -> list[list[Sample]]:
    """Miles' buffer (`list[list[Sample]]`) for parked PromptGroups: each group's partial
    samples, with the group's prompt text and data index."""
    return [
        [
            sample_from_pb(
                s, prompt=g.prompt_text, group_index=g.data_index, label_json=g.label_json
            )
            for s in g.partial_samples
        ]
        for g in groups
    ]


_MILES_ROLLOUT_PARAMS = {"rollout_id", "data_source", "evaluation"}


def check_rollout_function(fn: Any, path: str) -> None:
    """MillstreamError for Miles' whole-batch rollout function (its parameter names give it
    away), which cannot mean the same thing here: each worker serves one admitted group."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return
    if _MILES_ROLLOUT_PARAMS & set(params):
        raise PluginSignatureError(
            f"--rollout-function-path {path}: Miles' generate_rollout(args, rollout_id, "
            "data_source, evaluation=False) drives a whole rollout batch; in millstream the "
            "trainer admits groups and each rollout worker serves one group, so write the "
            "per-group form instead: async fn(group: PromptGroup, cfg, client: RouterClient) "
            "-> SampleGroup (for a custom reward or filter use --custom-rm-path and "
            "--dynamic-sampling-filter-path, which take Miles' signatures)"
        )


# flag -> (the parameters of millstream's old signature, Miles' signature to write instead)
OLD_SIGNATURES: dict[str, tuple[tuple[str, ...], str]] = {
    "--custom-rm-path": (("sample", "cfg"), "fn(args, sample) -> float"),
    "--custom-rm-path --group-rm": (("samples", "cfg"), "fn(args, samples) -> list[float]"),
    "--dynamic-sampling-filter-path": (
        ("samples", "cfg"),
        "fn(args, samples, **kwargs) -> DynamicFilterOutput",
    ),
    "--buffer-filter-path": (
        ("groups",),
        "fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]",
    ),
}


def check_not_old_signature(fn: Any, flag: str, path: str) -> None:
    """PluginSignatureError for a plugin written for millstream's old signatures (exactly their
    parameter names), which would now be called with Miles' arguments."""
    old, miles = OLD_SIGNATURES[flag]
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return
    if params == old:
        raise PluginSignatureError(
            f"{flag.split()[0]} {path} takes ({', '.join(old)}), millstream's old signature; "
            f"it is now called as Miles calls it: write {miles} (args: Miles' read-only flags, "
            "samples: millstream.compat.miles.Sample)"
        )


def named_error(err: Exception, flag: str, path: str | None) -> Exception:
    """`err` again, its message followed by the plugin's flag and path (same type when the
    type takes a message, else RuntimeError); raise it `from err`."""
    message = f"{err} ({flag} {path})"
    try:
        named = type(err)(message)
    except Exception:
        return RuntimeError(f"{message} ({type(err).__name__})")
    return named if str(named) == message else RuntimeError(message)


def is_async(fn: Any) -> bool:
    """`fn` is a coroutine function (or an object whose __call__ is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - async callable objects
    )
