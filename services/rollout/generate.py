"""Samples built from the engine's `/generate` answers (SGLang's response format).

A sample grows by one answer at a time: a plain rollout takes one answer; a partial rollout
resumed after a weight sync takes one per part; a multi-turn plugin may add its own tokens
between answers. For every answer, per response token:

  response_token_ids += the token ids of meta_info.output_token_logprobs
                        (checked against output_ids when the engine sends both)
  rollout_logprobs   += their logprobs
  weight_versions    += the version that produced each token: SGLang's meta_info.weight_versions
                        spans ({version, start, end} over the answer's output tokens) when the
                        request ran across a weight update (--pause-mode in_place or retract),
                        else int(meta_info.weight_version) for the whole part
  loss_mask          += 1 (`mask`; 0 for tokens the policy did not produce, e.g. tool output)

so the four lists always have one entry per response token, and a resumed sample carries the
versions of both sides of the sync. `finish_reason`/`status` are those of the latest answer.
`--mask-offpolicy-in-partial-rollout` zeroes the mask of everything produced before a resume
(`mask_prefix`), as Miles does. An engine that reports a weight version that is not an
integer (SGLang's default is "default") is taken to serve the group's admitted version.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from millstream.common.types import PromptGroup, Sample, SampleStatus, status_from_finish_reason

from .client import GenerationFailed

log = logging.getLogger("millstream.rollout")

FINISHED = (SampleStatus.SAMPLE_STATUS_COMPLETED, SampleStatus.SAMPLE_STATUS_TRUNCATED)


class BadAnswer(GenerationFailed):
    """The engine answered with something that is not a valid generation."""

    def __init__(self, message: str):
        super().__init__(message, retryable=False)


def new_sample(group: PromptGroup, index: int) -> Sample:
    """Sample `index` of `group` before generation; resumes a partial sample the group
    carries for that index (a group re-queued with its partial tokens)."""
    for carried in group.partial_samples:
        if carried.index == index:
            sample = Sample()
            sample.CopyFrom(carried)
            return sample
    return Sample(
        group_id=group.group_id,
        index=index,
        prompt_token_ids=group.prompt_token_ids,
        label=group.label,
        label_json=group.label_json,
        metadata_json=group.metadata_json,
    )


def is_finished(sample: Sample) -> bool:
    return sample.status in FINISHED


def next_input_ids(sample: Sample) -> list[int]:
    """What the engine continues from: the prompt and the response so far."""
    return [*sample.prompt_token_ids, *sample.response_token_ids]


def weight_version_of(meta: dict[str, Any], fallback: int) -> int:
    return _version(meta.get("weight_version"), fallback)


def _version(raw: Any, fallback: int) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        log.debug("weight_version %r is not an integer; using %d", raw, fallback)
        return fallback


def token_versions(meta: dict[str, Any], count: int, fallback: int) -> list[int]:
    """The version of each of an answer's `count` new tokens: from SGLang's weight_versions
    spans (sglang/srt/utils/weight_versions.py: contiguous [start, end) from 0, the last one
    the version weight_version names) when it sends them, else weight_version for all. A
    token no span covers takes the last span's version."""
    spans = meta.get("weight_versions")
    if not spans:
        return [weight_version_of(meta, fallback)] * count
    versions: list[int] = []
    for span in spans:
        end = min(int(span["end"]), count)
        versions.extend([_version(span["version"], fallback)] * max(0, end - len(versions)))
    return versions + [_version(spans[-1]["version"], fallback)] * (count - len(versions))


def append_answer(
    sample: Sample, answer: dict[str, Any], *, fallback_version: int, mask: int = 1
) -> str:
    """Add one `/generate` answer to the sample (see module docstring); returns the finish
    type. BadAnswer when the answer lacks what a sample needs."""
    meta = answer.get("meta_info") or {}
    finish = (meta.get("finish_reason") or {}).get("type")
    pairs = meta.get("output_token_logprobs")
    if finish not in ("stop", "length", "abort") or pairs is None:
        raise BadAnswer(
            f"engine answer for sample {sample.index} of group {sample.group_id!r} has "
            f"finish_reason {meta.get('finish_reason')!r} and "
            f"{'no' if pairs is None else len(pairs)} output_token_logprobs; was "
            "return_logprob sent?"
        )
    token_ids = [int(pair[1]) for pair in pairs]
    output_ids = answer.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids:
        raise BadAnswer(
            f"engine answer for sample {sample.index} of group {sample.group_id!r}: output_ids "
            f"({len(output_ids)} tokens) disagree with output_token_logprobs "
            f"({len(token_ids)} tokens)"
        )
    sample.response_token_ids.extend(token_ids)
    sample.rollout_logprobs.extend(float(pair[0]) for pair in pairs)
    sample.weight_versions.extend(token_versions(meta, len(token_ids), fallback_version))
    sample.loss_mask.extend([mask] * len(token_ids))
    sample.response_text += answer.get("text") or ""
    sample.finish_reason = finish
    sample.status = status_from_finish_reason(finish)
    return finish


def append_tokens(sample: Sample, token_ids: list[int], text: str, *, version: int) -> None:
    """Add tokens the policy did not sample (a tool's output, a user turn): mask 0, logprob 0."""
    sample.response_token_ids.extend(token_ids)
    sample.rollout_logprobs.extend([0.0] * len(token_ids))
    sample.weight_versions.extend([version] * len(token_ids))
    sample.loss_mask.extend([0] * len(token_ids))
    sample.response_text += text


def mask_prefix(sample: Sample) -> None:
    """Take every token produced so far out of the loss (off-policy after a sync)."""
    sample.loss_mask[:] = [0] * len(sample.loss_mask)


def reset_response(sample: Sample) -> None:
    """Forget the response so far (an aborted sample regenerated from scratch)."""
    for name in ("response_token_ids", "rollout_logprobs", "weight_versions", "loss_mask"):
        sample.ClearField(name)
    sample.response_text = ""
    sample.ClearField("status")
    sample.ClearField("finish_reason")


def mark_truncated(sample: Sample) -> None:
    """A sample whose budget ran out exactly at an abort: it ends as if by length."""
    sample.finish_reason = "length"
    sample.status = SampleStatus.SAMPLE_STATUS_TRUNCATED


def add_rollout_metadata(sample: Sample, **info: Any) -> None:
    """Record the rollout's own facts under "rollout" in the sample's metadata JSON (kept as
    is when the data row's metadata is not a JSON object)."""
    sample.metadata_json = _with_rollout(sample.metadata_json, tuple(info.items()))


@functools.lru_cache(maxsize=1024)
def _with_rollout(metadata_json: str, info: tuple[tuple[str, Any], ...]) -> str:
    """`metadata_json` with `info` merged under "rollout". Cached: a group's samples mostly
    share both (a JSON round trip per sample was a tenth of the worker's CPU per group)."""
    try:
        data = json.loads(metadata_json) if metadata_json else {}
    except ValueError:
        return metadata_json
    if not isinstance(data, dict):
        return metadata_json
    prior = data.get("rollout")
    data["rollout"] = {**(prior if isinstance(prior, dict) else {}), **dict(info)}
    return json.dumps(data)
