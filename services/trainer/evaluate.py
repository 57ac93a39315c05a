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

from opentelemetry import context as otel_context
from opentelemetry import trace

from millstream.common import streams, telemetry
from millstream.common.types import PromptGroup, Verdict
from millstream.compat.miles import Sample, miles_samples

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
        # The last round's samples by eval set, in Miles' shape: the `data` of the custom eval
        # log function (log_hooks.py).
        self.last_data: dict[str, dict[str, list[Any]]] = {}

    async def run(self, iteration: int, version: int) -> dict[str, float]:
        """One eval round, traced as its own root span (stage `eval`) that every eval group
        of the round is a child of, linked to the iteration that ran it."""
        current = trace.get_current_span().get_span_context()
        with telemetry.tracer("millstream.trainer").start_as_current_span(
            "trainer.eval",
            context=otel_context.Context(),
            links=[trace.Link(current)] if current.is_valid else [],
            attributes={
                telemetry.STAGE: "eval",
                "millstream.iteration": iteration,
                "millstream.version": version,
            },
        ):
            return await self._round(iteration, version)

    async def _round(self, iteration: int, version: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        self.last_data = {}
        for name, source in self.datasets.items():
            ids = [f"eval-{name}-r{iteration}-i{row.data_index}" for row in source.rows]
            messages = [
                PromptGroup(
                    group_id=gid,
                    data_index=row.data_index,
                    prompt_token_ids=row.prompt_token_ids,
                    prompt_text=row.prompt_text,
                    label=row.label,
                    label_json=row.label_json,
                    metadata_json=json.dumps(row.metadata),
                    n_samples=self.n_samples,
                    admitted_version=version,
                    is_eval=True,
                    eval_name=name,
                    admitted_unix=time.time(),
                    run_instance=self.buffer.run_instance,
                )
                for gid, row in zip(ids, source.rows, strict=True)
            ]
            start = time.monotonic()
            await streams.publish_many(self.redis, self.stream, messages, telemetry.inject_fields())
            results = await self.buffer.wait_eval(ids)
            rewards, samples, failed = [], [], 0
            for scored in results:
                if scored.verdict == Verdict.VERDICT_FAILED:
                    failed += 1
                    rewards += [0.0] * self.n_samples
                else:
                    rewards += [s.reward for s in scored.group.samples]
                    samples += miles_samples(scored.group)
            truncated = [s.status == Sample.Status.TRUNCATED for s in samples]
            self.last_data[name] = {"rewards": rewards, "truncated": truncated, "samples": samples}
            metrics[f"eval/{name}"] = sum(r > 0 for r in rewards) / len(rewards)
            metrics[f"eval/{name}_reward"] = statistics.fmean(rewards)
            metrics[f"eval/{name}_failed_groups"] = failed
            metrics[f"eval/{name}_seconds"] = time.monotonic() - start
        return metrics
