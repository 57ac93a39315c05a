"""Miles' plugin interfaces, as the interfaces: `args`, `Sample`, `DynamicFilterOutput`.

A plugin written for Miles (radixark/miles) runs here unchanged where the hook means the same
thing in a disaggregated system. Each worker builds one `args` from the resolved RunConfig
(`make_args`) and converts its wire messages (protobuf, common/types.py) to Miles' `Sample` at
the edge, in this module only (`sample_from_pb`, `sample_to_pb`, `groups_from_pb`).

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

`Sample` follows miles/utils/types.py: `tokens` is prompt + response token ids,
`response_length` the response's share of them, `loss_mask` and `rollout_log_probs` one per
response token, `status` a `Sample.Status`. Differences, all from the wire message: `index`
is the sample's index inside its group (0 .. n-1; Miles numbers samples globally),
`group_index` is the prompt's position in the data source when known, `weight_versions` has
one entry per response token (Miles: one per generate call), `reward` is None before scoring,
and millstream adds `group_id`, `finish_reason` and `failure_reason`. Fields with no wire
counterpart (multimodal inputs, `remove_sample`, teacher logprobs, ...) are not carried back.

A plugin keeps Miles' imports: `load_function` (common/plugins.py) first puts stand-ins for
Miles' modules in `sys.modules` when Miles itself is not installed (`install_miles_modules`), so
`from miles.utils.types import Sample`, `from miles.rollout.filter_hub.base_types import
DynamicFilterOutput` and `from miles.rollout.data_source import DataSource` import the types of
this module, and `from miles.utils.http_utils import post` its `http_post`. Any other Miles module stays missing, and the loader's error says so.

Loads without torch.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
import inspect
import json
import sys
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .config import GROUPS, RunConfig
from .errors import MillstreamError
from .types import PromptGroup, SampleGroup, SampleStatus
from .types import Sample as PbSample

__all__ = [
    "MILES_MODULES",
    "Args",
    "DataSource",
    "DynamicFilterOutput",
    "PluginSignatureError",
    "Sample",
    "check_not_old_signature",
    "check_rollout_function",
    "groups_from_pb",
    "http_post",
    "install_miles_modules",
    "is_async",
    "make_args",
    "miles_samples",
    "named_error",
    "sample_from_pb",
    "sample_to_pb",
    "samples_from_pb",
]


class PluginSignatureError(MillstreamError):
    """A plugin written for a Miles hook that cannot mean the same thing here."""


class Args:
    """Miles' `args`: every flag of the run by its Miles name (`args.rollout_batch_size`),
    read-only. Built from the resolved RunConfig: the fields of all its groups, plus `mode`.
    Setting or deleting an attribute raises AttributeError; a name that is no flag here raises
    AttributeError naming it, so `getattr(args, name, default)` works as it does on Miles'."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
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
    return Args(values)


@dataclass
class DynamicFilterOutput:
    """What a dynamic-sampling filter returns (Miles' filter_hub/base_types.py)."""

    keep: bool
    reason: str | None = None


@dataclass
class Sample:
    """One sample, with the fields and meaning of Miles' `Sample` (see the module docstring)."""

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    train_metadata: dict | None = None
    # millstream's, from the wire message
    group_id: str = ""
    finish_reason: str = ""
    failure_reason: str = ""

    def get_reward_value(self, args: Any) -> float:
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key and isinstance(self.reward, dict) else self.reward

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.response_length]

    @property
    def response_tokens(self) -> list[int]:
        return (
            self.tokens[len(self.tokens) - self.response_length :] if self.response_length else []
        )

    def to_dict(self) -> dict[str, Any]:
        value = dict(self.__dict__)
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", "pending"))
        names = {f.name for f in dataclasses.fields(Sample)}
        return Sample(**{k: v for k, v in data.items() if k in names})


class DataSource(abc.ABC):
    """Miles' DataSource (miles/rollout/data_source.py), what --data-source-path names: a
    class built with `args` whose `get_samples(n)` returns n groups, each a list of
    n_samples_per_prompt `Sample`s of one prompt (trainer/data.py PluginDataSource says how
    the trainer reads them). `save(rollout_id)` runs with every checkpoint and
    `load(rollout_id)` on resume, with the checkpoint's rollout id (None: a fresh start).
    `add_samples`, Miles' way back for aborted groups, is never called here: those groups stay
    in the rollout workers' partial buffer (--buffer-filter-path orders it)."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """The next num_samples groups."""

    @abc.abstractmethod
    def save(self, rollout_id: int) -> None:
        """Keep the position in the data, for a resume at rollout_id."""

    @abc.abstractmethod
    def load(self, rollout_id: int | None = None) -> None:
        """Go back to the position saved at rollout_id."""

    def get_buffer_length(self) -> int | None:
        return None


_HTTP: Any = None  # http_post's client: one per process, keep-alive


async def http_post(
    url: str,
    payload: dict[str, Any] | None,
    max_retries: int = 60,
    action: str = "post",
    headers: Any = None,
) -> Any:
    """Miles' `miles.utils.http_utils.post`: `action` (post, or get/delete without a payload)
    and the JSON answer (the text when it is not JSON). As Miles' does, any failure, an HTTP
    error status included (a router answering 503 while the engines take new weights), is
    tried again once a second, `max_retries` tries in all, and the last one raises."""
    import asyncio

    import httpx

    global _HTTP
    if _HTTP is None:
        _HTTP = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_keepalive_connections=64))
    if max_retries < 1:
        raise ValueError(f"max_retries {max_retries}: must be >= 1")
    for attempt in range(1, max_retries + 1):
        try:
            if action in ("get", "delete"):
                response = await getattr(_HTTP, action)(url, headers=headers)
            else:
                response = await getattr(_HTTP, action)(url, json=payload or {}, headers=headers)
            response.raise_for_status()
        except httpx.HTTPError:
            if attempt == max_retries:
                raise
            await asyncio.sleep(1)
            continue
        try:
            return response.json()
        except ValueError:
            return response.text
    raise AssertionError("unreachable")


# Miles' module -> the names this module stands in for there (install_miles_modules).
MILES_MODULES: dict[str, dict[str, Any]] = {
    "miles": {},
    "miles.utils": {},
    "miles.utils.types": {"Sample": Sample},
    "miles.utils.http_utils": {"post": http_post},
    "miles.rollout": {},
    "miles.rollout.filter_hub": {},
    "miles.rollout.filter_hub.base_types": {"DynamicFilterOutput": DynamicFilterOutput},
    "miles.rollout.data_source": {"DataSource": DataSource},
}


def install_miles_modules() -> bool:
    """Stand-ins for MILES_MODULES in sys.modules, unless Miles itself is installed; True when
    `import miles.utils.types` now gives this module's Sample. Idempotent."""
    present = sys.modules.get("miles")
    if present is not None:
        return bool(getattr(present, "__millstream__", False))
    if importlib.util.find_spec("miles") is not None:
        return False  # the real Miles: its imports are its own
    for name, attrs in MILES_MODULES.items():
        module = types.ModuleType(name, f"millstream's stand-in for Miles' {name}")
        module.__millstream__ = True  # type: ignore[attr-defined]
        if not attrs:
            module.__path__ = []  # a package: its other submodules are "No module named"
        module.__dict__.update(attrs)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True


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


def sample_from_pb(
    pb: PbSample,
    *,
    prompt: str | list[dict[str, str]] = "",
    group_index: int | None = None,
    scored: bool = False,
) -> Sample:
    """Miles' Sample for the wire `pb`. `prompt`: the group's prompt text (the wire sample has
    none); `scored`: the reward on the wire is real (after the reward stage), else None."""
    response = list(pb.response_token_ids)
    return Sample(
        group_index=group_index,
        index=pb.index,
        prompt=prompt,
        tokens=list(pb.prompt_token_ids) + response,
        response=pb.response_text,
        response_length=len(response),
        label=pb.label,
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
    return PbSample(
        group_id=sample.group_id,
        index=sample.index or 0,
        prompt_token_ids=sample.prompt_tokens,
        response_token_ids=sample.response_tokens,
        response_text=sample.response,
        label=sample.label or "",
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
    pbs: Iterable[PbSample], prompt: str = "", *, scored: bool = False
) -> list[Sample]:
    return [sample_from_pb(s, prompt=prompt, scored=scored) for s in pbs]


def miles_samples(group: SampleGroup) -> list[Sample]:
    """Miles' Samples of a scored wire group: its prompt text, data index and rewards."""
    return [
        sample_from_pb(
            s, prompt=group.prompt.prompt_text, group_index=group.prompt.data_index, scored=True
        )
        for s in group.samples
    ]


def groups_from_pb(groups: Sequence[PromptGroup]) -> list[list[Sample]]:
    """Miles' buffer (`list[list[Sample]]`) for parked PromptGroups: each group's partial
    samples, with the group's prompt text and data index."""
    return [
        [
            sample_from_pb(s, prompt=g.prompt_text, group_index=g.data_index)
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
            "samples: millstream.common.miles.Sample)"
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
