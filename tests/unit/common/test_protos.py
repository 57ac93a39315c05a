"""The generated code under services/common/pb matches protos/, and messages round-trip."""

from __future__ import annotations

import filecmp
from pathlib import Path

from millstream.common.types import (
    PromptGroup,
    Sample,
    SampleGroup,
    SampleStatus,
    ScoredGroup,
    Verdict,
    status_from_finish_reason,
)
from millstream.tools import protogen


def test_generated_code_is_not_stale(tmp_path: Path):
    protogen.generate(tmp_path)
    committed = sorted(p.name for p in protogen.OUT_DIR.iterdir() if p.is_file())
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert committed == fresh, "services/common/pb is out of date: run `make protos`"
    _, mismatch, errors = filecmp.cmpfiles(protogen.OUT_DIR, tmp_path, fresh, shallow=False)
    assert not mismatch and not errors, f"stale generated files {mismatch}: run `make protos`"


def test_scored_group_round_trips_with_every_sample_field():
    sample = Sample(
        group_id="g1", index=1, prompt_token_ids=[1, 2], response_token_ids=[3, 4, 5],
        response_text="12", label="12", loss_mask=[1, 1, 0], rollout_logprobs=[-0.5, -0.25, -1.0],
        weight_versions=[3, 3, 4], status=SampleStatus.SAMPLE_STATUS_TRUNCATED, reward=1.0,
        metadata_json='{"k": 1}', finish_reason="length",
    )  # fmt: skip
    group = SampleGroup(
        prompt=PromptGroup(group_id="g1", n_samples=2, admitted_version=3), samples=[sample]
    )
    group.timings["rollout"] = 1.5
    scored = ScoredGroup(group=group, verdict=Verdict.VERDICT_KEPT)
    back = ScoredGroup.FromString(scored.SerializeToString())
    assert back == scored
    assert list(back.group.samples[0].weight_versions) == [3, 3, 4]


def test_finish_reason_maps_to_status():
    assert status_from_finish_reason("stop") == SampleStatus.SAMPLE_STATUS_COMPLETED
    assert status_from_finish_reason("length") == SampleStatus.SAMPLE_STATUS_TRUNCATED
    assert status_from_finish_reason("abort") == SampleStatus.SAMPLE_STATUS_ABORTED
