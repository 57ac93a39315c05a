"""Plugins written exactly as Miles' docs show them (docs/user-guide/customization.md), Miles'
imports and all (millstream stands in for those modules: compat/miles/):

--custom-rm-path tests.support.miles_plugins.custom_rm
--custom-rm-path tests.support.miles_plugins.batched_custom_rm   (with --group-rm)
--dynamic-sampling-filter-path tests.support.miles_plugins.filter_function
--buffer-filter-path tests.support.miles_plugins.buffer_filter
--data-source-path tests.support.miles_plugins.JsonlDataSource
--rollout-sample-filter-path tests.support.miles_plugins.sample_filter
--custom-rollout-log-function-path tests.support.miles_plugins.log_rollout_data
--custom-generate-function-path tests.support.miles_plugins.generate

Each reads what Miles gives it (args' flags, the Sample's fields) so a test sees that the
values arrived; the buffer filter prints a line the test finds in the worker's log, and the
data source and log function write files under --run-dir.

The e2e set (`JsonlDataSource`, `generate`, `length_rm`, `drop_marked`, `sample_filter`,
`log_rollout_data`) is deterministic on any model: the data source marks every third prompt
`drop` and the dynamic filter drops those; the sample filter leaves sample 0 of every group
out of the loss.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import sys

from miles.rollout.data_source import DataSource
from miles.rollout.filter_hub.base_types import DynamicFilterOutput
from miles.utils.http_utils import post
from miles.utils.types import Sample


async def custom_rm(args, sample: Sample) -> float:
    """1 when the response equals the label; the metadata can ask for a bonus, and the prompt
    and Miles' args must be there."""
    await asyncio.sleep(0)
    assert sample.reward is None, "the reward is not known yet"
    assert isinstance(sample.prompt, str) and sample.prompt, "the group's prompt"
    assert args.rollout_batch_size >= 1 and args.custom_rm_path.endswith("custom_rm")
    if sample.status == Sample.Status.ABORTED:
        return 0.0
    reward = 1.0 if sample.response.strip() == (sample.label or "").strip() else 0.0
    return reward + float(sample.metadata.get("bonus", 0.0))


async def batched_custom_rm(args, samples: list[Sample]) -> list[float]:
    """Batched mode (--group-rm): 1 for the longest response text of the group, else 0."""
    assert args.group_rm
    longest = max(range(len(samples)), key=lambda i: (len(samples[i].response), -i))
    return [1.0 if i == longest else 0.0 for i in range(len(samples))]


def filter_function(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep a group only when its rewards differ (DAPO), with Miles' reason naming."""
    rewards = [sample.get_reward_value(args) for sample in samples]
    if len(set(rewards)) > 1:
        return DynamicFilterOutput(keep=True, reason=None)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")


def buffer_filter(
    args,
    rollout_id: int | None,
    buffer: list[list[Sample]],
    num_samples: int,
) -> list[list[Sample]]:
    """Pop the groups with the most generated tokens first (Miles' pop_first, reordered)."""
    buffer.sort(key=lambda group: -sum(s.response_length for s in group))
    num_to_pop = min(len(buffer), num_samples)
    samples = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    tokens = [sum(s.response_length for s in group) for group in samples]
    print(
        f"miles buffer_filter: rollout_id={rollout_id} popped {len(samples)} of {num_samples} "
        f"(tokens {tokens}, partial_rollout={args.partial_rollout})",
        file=sys.stderr,
        flush=True,
    )
    return samples


class JsonlDataSource(DataSource):
    """Miles' DataSource over --prompt-data (the --input-key / --label-key rows), in order, with
    Miles' group and sample numbering; every third prompt's metadata says `drop`."""

    def __init__(self, args):
        self.args = args
        with open(args.prompt_data, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        self.samples = [
            Sample(
                prompt=row[args.input_key],
                label=row[args.label_key],
                metadata={"drop": i % 3 == 2, "row": i},
            )
            for i, row in enumerate(rows)
        ]
        self.offset = 0
        self.sample_group_index = 0
        self.sample_index = 0

    def get_samples(self, num_samples):
        groups = []
        for _ in range(num_samples):
            prompt_sample = self.samples[self.offset % len(self.samples)]
            self.offset += 1
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt_sample)
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def _path(self, rollout_id):
        return os.path.join(self.args.run_dir, f"data_source_{rollout_id}.json")

    def save(self, rollout_id):
        with open(self._path(rollout_id), "w", encoding="utf-8") as f:
            json.dump({"offset": self.offset, "sample_group_index": self.sample_group_index,
                       "sample_index": self.sample_index}, f)  # fmt: skip

    def load(self, rollout_id=None):
        if rollout_id is None or not os.path.exists(self._path(rollout_id)):
            return
        with open(self._path(rollout_id), encoding="utf-8") as f:
            state = json.load(f)
        self.offset = state["offset"]
        self.sample_group_index = state["sample_group_index"]
        self.sample_index = state["sample_index"]


async def generate(args, sample: Sample, sampling_params) -> Sample:
    """Miles' single-turn generate (the shape of miles/rollout/sglang_rollout.py `generate`):
    one /generate through the router, the sample filled in from SGLang's answer."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    if sample.response_length:  # a resume after an abort (--partial-rollout): what is left
        sampling_params["max_new_tokens"] -= sample.response_length
    payload = {"input_ids": sample.tokens, "sampling_params": sampling_params,
               "return_logprob": True}  # fmt: skip
    output = await post(url, payload)
    meta = output["meta_info"]
    new_tokens = [item[1] for item in meta["output_token_logprobs"]]
    sample.tokens = sample.tokens + new_tokens
    sample.response_length += len(new_tokens)
    sample.response += output["text"]
    if sample.loss_mask is not None:  # a resume whose old part is masked: the new part trains
        sample.loss_mask += [1] * len(new_tokens)
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [
        item[0] for item in meta["output_token_logprobs"]
    ]
    sample.weight_versions.append(meta["weight_version"])
    match meta["finish_reason"]["type"]:
        case "length":
            sample.status = Sample.Status.TRUNCATED
        case "abort":
            sample.status = Sample.Status.ABORTED
        case "stop":
            sample.status = Sample.Status.COMPLETED
    sample.metadata["generated_by"] = "miles generate"
    return sample


async def length_rm(args, sample: Sample) -> float:
    """A reward any model earns: the response's length in characters, so rewards differ."""
    return float(len(sample.response))


def drop_marked(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Drop the groups whose prompt the data source marked (Miles' reason naming)."""
    if samples[0].metadata.get("drop"):
        return DynamicFilterOutput(keep=False, reason="marked_drop")
    return DynamicFilterOutput(keep=True)


def sample_filter(args, data: list[list[Sample]]) -> None:
    """Miles' per-sample loss filter: sample 0 of every group leaves the loss."""
    for group in data:
        for s in group:
            if s.index == 0:
                s.remove_sample = True


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """One JSON line per rollout under --run-dir: what Miles' log function would see."""
    record = {
        "rollout_id": rollout_id,
        "n_samples_per_prompt": args.n_samples_per_prompt,
        "samples": [_fields(s) for s in samples],
        "raw_reward": rollout_extra_metrics.get("rollout/raw_reward"),
        "rollout_time": rollout_time,
    }
    with open(os.path.join(args.run_dir, "miles_log.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return False


def _fields(s: Sample) -> dict:
    names = ("prompt", "response", "label", "group_index", "index", "reward", "loss_mask",
             "response_length", "metadata")  # fmt: skip
    return {name: getattr(s, name) for name in names}
