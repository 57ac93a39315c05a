"""Miles' `miles.rollout.rm_hub`: `async_rm`, `batched_async_rm` and the graders they call.

The graders are the very functions millstream's built-in --rm-types call (the reward service
imports them from here), so a plugin that does `from miles.rollout.rm_hub import
grade_answer_verl` grades exactly as `--rm-type math` does. One module per Miles module:
math_utils (math), math_dapo_utils (dapo), deepscaler (deepscaler, gemma_math), f1, gpqa.

`async_rm(args, sample)` scores one Miles `Sample` as Miles does: a custom reward named by
`sample.reward_spec.custom_rm_path` or `args.custom_rm_path` is awaited with (args, sample);
otherwise the rm_type is `sample.reward_spec.rm_type`, else `sample.metadata["rm_type"]`, else
`args.rm_type`. A `boxed_` prefix first replaces the response with its last `\\boxed{...}`'s
contents ("" without one). Then:

    remote_rm             what POST args.rm_url answers for {"prompt", "response", "label"}
    math                  1 / 0, math_utils.grade_answer_verl
    deepscaler            1 / 0, deepscaler.get_deepscaler_rule_based_reward
    gemma_math            1 / 0, deepscaler.get_gemma_math_reward
    dapo                  Miles' dict, math_dapo_utils.compute_score
    f1                    f1.f1_score's F1
    gpqa                  1.0 / 0.0, gpqa.compute_gpqa_reward (reads sample.metadata)
    random                0 or 1 at random
    deterministic_random  sha256(str(tokens) + response)'s first byte % 2

Miles' `ifbench` is not here (it clones IFBench at run time): asking for it, or for any other
type, raises NotImplementedError naming it. `batched_async_rm(args, samples)` calls
`args.custom_rm_path` once with the whole list when it is set (Miles' group form), else
`async_rm` per sample, concurrently; with `inplace_set_reward_field` it sets each
`sample.reward` (which must still be None) and returns None. A custom reward may be sync here
(Miles awaits it, so it must be async there).

Imports no torch and no sympy: the math graders load sympy on first use.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import random
from typing import Any

from ..http_utils import post
from ..misc import load_function
from .deepscaler import get_deepscaler_rule_based_reward, get_gemma_math_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .math_dapo_utils import compute_score as compute_score_dapo
from .math_utils import extract_answer as extract_boxed_answer
from .math_utils import grade_answer_verl

__all__ = [
    "async_rm",
    "batched_async_rm",
    "compute_gpqa_reward",
    "compute_score_dapo",
    "extract_boxed_answer",
    "f1_score",
    "get_deepscaler_rule_based_reward",
    "get_gemma_math_reward",
    "grade_answer_verl",
    "remote_rm",
]

BOXED_PREFIX = "boxed_"


async def remote_rm(args: Any, sample: Any) -> Any:
    """The JSON answer of POST `args.rm_url` (one try; an HTTP error status raises)."""
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await post(args.rm_url, payload, max_retries=1)


def _metadata(sample: Any) -> dict:
    return sample.metadata if isinstance(sample.metadata, dict) else {}


def _reward_config(args: Any, sample: Any) -> tuple[str | None, str]:
    """(custom reward path, rm_type): the sample's reward_spec wins where it says something."""
    spec = getattr(sample, "reward_spec", None)
    custom = (spec.custom_rm_path if spec is not None else None) or getattr(
        args, "custom_rm_path", None
    )
    rm_type = (
        (spec.rm_type if spec is not None else None)
        or _metadata(sample).get("rm_type")
        or getattr(args, "rm_type", None)
        or ""
    )
    return custom, rm_type.strip()


async def _called(fn: Any, *args: Any, **kwargs: Any) -> Any:
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    custom, rm_type = _reward_config(args, sample)
    if custom:
        return await _called(load_function(custom), args, sample, **kwargs)
    response, label, metadata = sample.response, sample.label, _metadata(sample)
    if rm_type.startswith(BOXED_PREFIX):
        response = extract_boxed_answer(response) or ""
        rm_type = rm_type[len(BOXED_PREFIX) :]
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    if rm_type == "deepscaler":
        return get_deepscaler_rule_based_reward(response, label)
    if rm_type == "gemma_math":
        return get_gemma_math_reward(response, label)
    if rm_type == "dapo":
        return compute_score_dapo(response, label)
    if rm_type == "math":
        return 1 if grade_answer_verl(response, label) else 0
    if rm_type == "f1":
        return f1_score(response, label)[0]
    if rm_type == "gpqa":
        return compute_gpqa_reward(response, label, metadata=metadata)
    if rm_type == "random":
        return random.randint(0, 1)
    if rm_type == "deterministic_random":
        digest = hashlib.sha256((str(sample.tokens) + response).encode()).digest()
        return digest[0] % 2
    if rm_type:
        raise NotImplementedError(f"rule-based rm_type {rm_type!r} is not implemented here")
    raise NotImplementedError("no rm_type: set --rm-type, metadata['rm_type'] or --custom-rm-path")


async def batched_async_rm(
    args: Any, samples: list[Any], inplace_set_reward_field: bool = False, **kwargs: Any
) -> list[Any] | None:
    if inplace_set_reward_field:
        rewards = await batched_async_rm(args, samples, **kwargs)
        assert rewards is not None
        for sample, reward in zip(samples, rewards, strict=True):
            if sample.reward is not None:
                raise ValueError(
                    f"sample {sample.index} already has reward {sample.reward!r} (would be "
                    f"{reward!r}); batched_async_rm sets only unscored samples"
                )
            sample.reward = reward
        return None
    custom = getattr(args, "custom_rm_path", None)
    if custom:
        return await _called(load_function(custom), args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
