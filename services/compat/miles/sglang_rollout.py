"""Miles' `miles.rollout.sglang_rollout`: `GenerateState`, `generate`, `generate_and_rm`, ...

The per-sample parts of Miles' default rollout, for plugins that build on them (a custom
generate function that calls `generate`, or reads `GenerateState(args).tokenizer` and
`.sampling_params`):

* `GenerateState(args)`: one per process (SingletonMeta): the tokenizer of --hf-checkpoint,
  the processor (None for a text model), a semaphore of sglang_server_concurrency x
  engines, Miles' `sampling_params` from the rollout flags, and dp-rank balancing.
* `generate(args, sample, sampling_params) -> Sample`: one token-in, token-out POST to the
  router's /generate (SGLang's form, which millstream's engines and router speak) with
  `return_logprob`; the answer's tokens, text and log-probs are appended to the sample
  (`tokens`, `response`, `response_length`, `rollout_log_probs`, `loss_mask` when it has
  one), and `status`, `weight_versions` and `finish_reason` come from its meta_info. A
  sample with a response already continues from `tokens` (Miles' partial rollout), with the
  budget of new tokens cut by what it has. One difference: a sample that already holds its
  prompt tokens (millstream hands the group's prompt, tokenized at admission, to a generate
  function that way) is sent as those tokens, not re-tokenized from its text.
* `generate_and_rm(args, sample, sampling_params, evaluation=False)`: the sample's or the
  run's custom generate function (Miles' older or newer form, base_types.py) else
  `generate`, then its reward through rm_hub's `async_rm` (unless --group-rm);
  `generate_and_rm_group` does a group at once, and with --group-rm rewards it as a group.
* `get_model_url(args, name, endpoint)`: the router URL for a named model
  (`sglang_model_routers`), else the default router.

`generate_rollout`, Miles' whole-batch rollout, keeps its signature so a path naming it loads,
and is refused as every whole-batch rollout function is (package docstring). Miles' LoRA
adapters, routing and indexer replay and OPD top-logprobs are not built here: a sample bound to
an adapter raises. Flags millstream's config lacks are read with Miles' defaults: `ci_test`,
`sglang_dp_size`, `sglang_enable_deterministic_inference`, `sglang_router_policy`,
`sglang_speculative_algorithm`, `sglang_model_routers`, `chat_template_path` (off).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .base_types import GenerateFnInput, load_generate_function
from .http_utils import post
from .misc import SingletonMeta
from .processing_utils import (
    call_processor,
    encode_image_for_rollout_engine,
    extract_multimodal_train_inputs,
    load_processor,
    load_tokenizer,
)
from .types import Sample

__all__ = [
    "GenerateState",
    "generate",
    "generate_and_rm",
    "generate_and_rm_group",
    "generate_rollout",
    "get_model_url",
]


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """The URL of `endpoint` on the router serving `model_name` (--sglang-config's model
    routers), or on the default router when there is no such model."""
    routers = getattr(args, "sglang_model_routers", None)
    if routers and model_name in routers:
        ip, port = routers[model_name]
        return f"http://{ip}:{port}{endpoint}"
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


def _engine_count(args: Any) -> int:
    per_engine = getattr(args, "rollout_num_gpus_per_engine", None) or 1
    gpus = getattr(args, "rollout_num_gpus", None)
    if gpus:
        return max(1, gpus // per_engine)
    return getattr(args, "rollout_num_engines", None) or 1


class GenerateState(metaclass=SingletonMeta):
    """What every generate call of this process shares (see the module docstring)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        path = getattr(args, "hf_checkpoint", None) or getattr(args, "ref_load", None)
        if not path:
            raise ValueError("GenerateState needs --hf-checkpoint for its tokenizer")
        self.tokenizer = load_tokenizer(
            path, chat_template_path=getattr(args, "chat_template_path", None)
        )
        self.processor = load_processor(path)
        concurrency = args.sglang_server_concurrency or 512
        self.semaphore = asyncio.Semaphore(max(1, concurrency * _engine_count(args)))
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
            stop=_list_or_none(args.rollout_stop),
            stop_token_ids=_list_or_none(args.rollout_stop_token_ids),
            skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True,
            spaces_between_special_tokens=False,
        )
        if getattr(args, "sglang_enable_deterministic_inference", False):
            base = args.rollout_seed
            self.group_sampling_seeds = [base + i for i in range(args.n_samples_per_prompt)]
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", None) or 1)
        self.dp_rank = 0
        self.reset()

    @contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        """A least-busy data-parallel rank (ties broken at random), busy while inside."""
        least = min(self.dp_counts)
        rank = random.choice([i for i, count in enumerate(self.dp_counts) if count == least])
        self.dp_counts[rank] += 1
        self.dp_rank = rank
        try:
            yield rank
        finally:
            self.dp_counts[rank] -= 1

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task] = set()
        self.aborted = False

    def submit_generate_tasks(self, samples: list[list[Sample]]) -> None:
        """A task per group (`generate_and_rm_group`), kept in `pendings`."""
        for group in samples:
            task = generate_and_rm_group(
                self.args, group, sampling_params=self.sampling_params.copy(), evaluation=False
            )
            self.pendings.add(asyncio.create_task(task))
        self.remaining_batch_size += len(samples)


def _list_or_none(value: Any) -> list | None:
    return list(value) if value is not None else None


def _prompt_ids(state: GenerateState, sample: Sample) -> list[int]:
    media = sample.multimodal_inputs
    has_media = bool(media) and any(v is not None for v in media.values())
    if state.processor and (isinstance(sample.prompt, list | tuple) or has_media):
        output = call_processor(state.processor, sample.prompt, media)
        ids = output["input_ids"][0]
        sample.multimodal_train_inputs = extract_multimodal_train_inputs(output)
        return ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if sample.tokens:
        return list(sample.tokens)
    return state.tokenizer.encode(sample.prompt, add_special_tokens=False)


def _payload(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> dict[str, Any]:
    if sample.adapter is not None:
        raise NotImplementedError(
            f"sample {sample.index} is bound to LoRA adapter {sample.adapter.name!r}: "
            "millstream trains every parameter and serves no adapters"
        )
    payload: dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": True}
    media = sample.multimodal_inputs or {}
    if media.get("images"):
        payload["image_data"] = [encode_image_for_rollout_engine(x) for x in media["images"]]
    if media.get("audios"):
        import base64

        payload["audio_data"] = [
            "data:audio;base64," + base64.b64encode(a).decode("ascii") for a in media["audios"]
        ]
    return payload


def _routing_headers(args: Any, sample: Sample) -> dict[str, str] | None:
    if _routes_by_key(args) and not sample.routing_key:
        raise ValueError(
            f"router policy {args.sglang_router_policy} routes by X-SMG-Routing-Key, but "
            f"sample {sample.index} has no routing_key"
        )
    return {"X-SMG-Routing-Key": sample.routing_key} if sample.routing_key else None


def _routes_by_key(args: Any) -> bool:
    return getattr(args, "sglang_router_policy", None) in ("consistent_hashing", "manual")


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """One generate call for `sample` through the router (see the module docstring)."""
    if getattr(args, "ci_test", False) and not isinstance(sample.prompt, str):
        raise TypeError(f"ci_test: sample {sample.index}'s prompt is not text")
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"generate takes a pending or aborted sample, not {sample.status}")
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    continuing = len(sample.response) > 0
    if continuing:
        sampling_params["max_new_tokens"] -= sample.response_length
    else:
        prompt_ids = _prompt_ids(state, sample)
    if sampling_params["max_new_tokens"] < 0:
        raise ValueError(f"max_new_tokens {sampling_params['max_new_tokens']} is below 0")
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = _payload(args, sample, sampling_params)
    if continuing:
        payload["input_ids"] = sample.tokens
    else:
        payload["input_ids"] = prompt_ids
        if not sample.tokens:
            sample.tokens = prompt_ids
    output = await post(url, payload, headers=_routing_headers(args, sample))
    meta = output["meta_info"]
    pairs = meta.get("output_token_logprobs") or []  # [logprob, token id, text] per token
    new_tokens = [int(p[1]) for p in pairs]
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.response += output["text"]
    if sample.loss_mask is not None:  # partial rollout with the old part masked out
        sample.loss_mask += [1] * len(new_tokens)
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = []
    sample.rollout_log_probs += [p[0] for p in pairs]
    sample.update_from_meta_info(args, meta)
    return sample


async def generate_and_rm(
    args: Any,
    sample: Sample | list[Sample],
    sampling_params: dict[str, Any],
    evaluation: bool = False,
) -> Sample | list[Sample]:
    """Generate `sample` and score it (see the module docstring)."""
    if (
        getattr(args, "partial_rollout", False)
        and getattr(args, "mask_offpolicy_in_partial_rollout", False)
        and sample.response_length > 0
    ):
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample  # done before (a resumed group's finished sample)
    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        with state.dp_rank_context():
            path = sample.generate_function_path or getattr(
                args, "custom_generate_function_path", None
            )
            custom = load_generate_function(path) if path else None
            if custom is not None:
                output = await custom(
                    GenerateFnInput(
                        state=state,
                        sample=sample,
                        sampling_params=sampling_params,
                        evaluation=evaluation,
                    )
                )
                sample = output.samples
            else:
                sample = await generate(args, sample, sampling_params)
    if getattr(args, "group_rm", False):
        return sample  # the group is scored at once (generate_and_rm_group)
    from .rm_hub import async_rm, batched_async_rm

    if isinstance(sample, list):
        if any(s.status == Sample.Status.ABORTED for s in sample):
            return sample
        unscored = [s for s in sample if s.reward is None]  # some scored while generating
        for s, reward in zip(unscored, await batched_async_rm(args, unscored), strict=True):
            s.reward = reward
        return sample
    if sample.status != Sample.Status.ABORTED and sample.reward is None:
        sample.reward = await async_rm(args, sample)
    return sample


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Sample]:
    """generate_and_rm for every sample of the group at once; with --group-rm the group is
    then scored as a whole."""
    state = GenerateState(args)
    if state.aborted:
        return group
    if _routes_by_key(args):
        for sample in group:
            if sample.routing_key is None:
                sample.routing_key = str(uuid.uuid4())
    tasks = []
    for i, sample in enumerate(group):
        params = sampling_params.copy()
        if getattr(args, "sglang_enable_deterministic_inference", False):
            params["sampling_seed"] = state.group_sampling_seeds[i]
        tasks.append(generate_and_rm(args, sample, params, evaluation=evaluation))
    group = list(await asyncio.gather(*tasks))
    if not state.aborted and getattr(args, "group_rm", False):
        from .rm_hub import batched_async_rm

        for sample, reward in zip(group, await batched_async_rm(args, group), strict=True):
            sample.reward = reward
    return group


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """Miles' whole-batch rollout: refused here, with what to write instead."""
    from . import check_rollout_function

    check_rollout_function(generate_rollout, "miles.rollout.sglang_rollout.generate_rollout")
    raise AssertionError("unreachable: check_rollout_function refuses generate_rollout")
