"""The message types that cross the wire, for services and user plugins alike.

A reward or rollout plugin imports these (`from millstream.common.types import Sample`);
they are the generated protobuf classes of protos/millstream/v1, plus small helpers.
Loads without torch.
"""

from __future__ import annotations

from .pb.messages_pb2 import (
    PluginError,
    PromptGroup,
    Sample,
    SampleGroup,
    SampleStatus,
    ScoredGroup,
    Verdict,
)

__all__ = [
    "PluginError",
    "PromptGroup",
    "Sample",
    "SampleGroup",
    "SampleStatus",
    "ScoredGroup",
    "Verdict",
    "status_from_finish_reason",
]

_FINISH_TO_STATUS = {
    "stop": SampleStatus.SAMPLE_STATUS_COMPLETED,
    "length": SampleStatus.SAMPLE_STATUS_TRUNCATED,
    "abort": SampleStatus.SAMPLE_STATUS_ABORTED,
}


def status_from_finish_reason(finish_type: str) -> int:
    """Map SGLang's meta_info.finish_reason.type to a SampleStatus."""
    try:
        return _FINISH_TO_STATUS[finish_type]
    except KeyError:
        raise ValueError(
            f"unknown finish_reason type {finish_type!r} (expected stop, length or abort)"
        ) from None
