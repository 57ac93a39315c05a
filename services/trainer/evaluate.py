"""Eval through the same services: eval prompt groups go to `{run}:prompts` marked is_eval,
rollout workers apply the --eval-* sampling overrides, reward workers score them without the
dynamic-sampling filter, and the buffer hands them back here.

Accuracy is the fraction of eval samples with a positive reward (exact/math rewards are 0/1);
a failed eval group counts as wrong and is reported.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from millstream.common import streams, telemetry
from millstream.common.types import PromptGroup, Verdict

from .buffer import Buffer
from .data import PromptDataSource


def accuracies(names: list[str], metrics: dict[str, float]) -> dict[str, float]:
    """Each eval set's accuracy, picked by name (names may contain underscores)."""
    return {name: metrics[f"eval/{name}"] for name in names}


def format_accuracies(acc: dict[str, float]) -> str:
    return " ".join(f"{name}={value:.3f}" for name, value in acc.items())


class Evaluator:
    def __init__(
        self,
        redis: Any,
        stream: str,
        datasets: dict[str, PromptDataSource],
        n_samples: int,
        buffer: Buffer,
    ):
        self.redis = redis
        self.stream = stream
        self.datasets = datasets
        self.n_samples = n_samples
        self.buffer = buffer

    async def run(self, iteration: int, version: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, source in self.datasets.items():
            ids = [f"eval-{name}-r{iteration}-i{row.data_index}" for row in source.rows]
            messages = [
                PromptGroup(
                    group_id=gid,
                    data_index=row.data_index,
                    prompt_token_ids=row.prompt_token_ids,
                    prompt_text=row.prompt_text,
                    label=row.label,
                    metadata_json=json.dumps(row.metadata),
                    n_samples=self.n_samples,
                    admitted_version=version,
                    is_eval=True,
                    eval_name=name,
                    admitted_unix=time.time(),
                )
                for gid, row in zip(ids, source.rows, strict=True)
            ]
            start = time.monotonic()
            await streams.publish_many(self.redis, self.stream, messages, telemetry.inject_fields())
            results = await self.buffer.wait_eval(ids)
            rewards, failed = [], 0
            for scored in results:
                if scored.verdict == Verdict.VERDICT_FAILED:
                    failed += 1
                    rewards += [0.0] * self.n_samples
                else:
                    rewards += [s.reward for s in scored.group.samples]
            metrics[f"eval/{name}"] = sum(r > 0 for r in rewards) / len(rewards)
            metrics[f"eval/{name}_reward"] = statistics.fmean(rewards)
            metrics[f"eval/{name}_failed_groups"] = failed
            metrics[f"eval/{name}_seconds"] = time.monotonic() - start
        return metrics
