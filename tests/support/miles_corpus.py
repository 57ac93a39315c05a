"""Plugins in the shapes Miles' own examples have, importing what they import (our code).

Each function here is written the way a Miles user writes one, against Miles' public plugin
surface only (`miles.*` imports, Miles' signatures), and knows nothing of millstream:

* `generate_with_calculator`: a multi-turn tool-calling `--custom-generate-function-path`, in
  the shape of Miles' search-r1 example: `GenerateState(args)` for the tokenizer, Miles'
  `post` to the router's `/generate`, two model turns with a tool's answer between them (its
  tokens out of the loss, log-prob 0.0), statuses from `finish_reason`.
* `calculator_reward`: a `--custom-rm-path` that grades with `rm_hub`'s graders and reads a
  dict label (`sample.label["ground_truth"]`), as search-r1's reward does.
* `clipped_tis`: a `--custom-tis-function-path` with the signature of Miles' TIS functions.
* `log_rollout_data`: a `--custom-rollout-log-function-path` in the shape of Miles' default
  one (miles/ray/rollout/metrics.py): its metrics from `metric_utils`, handed to
  `tracking.log`; it also writes what it saw to a file.

The data source is Miles' own `miles.rollout.data_source.RolloutDataSourceWithBuffer`, named
by the flag as Miles' default is (tests/e2e/test_miles_corpus.py runs all of them at once).
"""

from __future__ import annotations

import json
import os
import re

from miles.rollout.rm_hub import f1
from miles.rollout.rm_hub.math_utils import grade_answer_verl
from miles.rollout.sglang_rollout import GenerateState
from miles.utils.http_utils import post
from miles.utils.iter_utils import group_by
from miles.utils.metric_utils import (
    compute_pass_rate,
    compute_rollout_step,
    compute_statistics,
    dict_add_prefix,
)
from miles.utils.misc import load_function  # noqa: F401 - imported as Miles' examples do
from miles.utils.tracking_utils import tracking
from miles.utils.types import Sample

MAX_TURNS = 2


def _calculator(prompt: str) -> str:
    """The tool: the sum the prompt asks for ("12+30=" -> " [42] ")."""
    match = re.match(r"\s*(\d+)\s*\+\s*(\d+)", prompt)
    return f" [{int(match.group(1)) + int(match.group(2))}] " if match else " [?] "


async def generate_with_calculator(args, sample: Sample, sampling_params) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    response, response_ids, loss_mask, log_probs = "", [], [], []
    finish = "stop"
    for turn in range(MAX_TURNS):
        payload = {
            "input_ids": prompt_ids + response_ids,
            "sampling_params": sampling_params,
            "return_logprob": True,
        }
        output = await post(url, payload)
        finish = output["meta_info"]["finish_reason"]["type"]
        if finish == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        pairs = output["meta_info"]["output_token_logprobs"]
        response += output["text"]
        response_ids += [token for _, token, _ in pairs]
        log_probs += [logprob for logprob, _, _ in pairs]
        loss_mask += [1] * len(pairs)
        if turn == MAX_TURNS - 1:
            break
        observation = _calculator(sample.prompt)
        obs_ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        response += observation
        response_ids += obs_ids
        log_probs += [0.0] * len(obs_ids)
        loss_mask += [0] * len(obs_ids)

    sample.tokens = prompt_ids + response_ids
    sample.response = response
    sample.response_length = len(response_ids)
    sample.loss_mask = loss_mask
    sample.rollout_log_probs = log_probs
    sample.metadata = {**sample.metadata, "turns": MAX_TURNS, "tool_tokens": loss_mask.count(0)}
    sample.status = {
        "length": Sample.Status.TRUNCATED,
        "stop": Sample.Status.COMPLETED,
    }.get(finish, Sample.Status.COMPLETED)
    return sample


async def calculator_reward(args, sample: Sample, **kwargs) -> float:
    """1 for the right sum after the tool's answer, else a little for the answer's overlap
    with the truth (rm_hub's f1), so a random model sees rewards that differ."""
    if not isinstance(sample.label, dict):
        raise TypeError(f"the label is {type(sample.label).__name__}, not the row's dict")
    truth = str(sample.label["ground_truth"])
    answer = sample.response.rsplit("]", 1)[-1].strip()
    if grade_answer_verl(f"\\boxed{{{answer}}}", truth):
        return 1.0
    return 0.5 * f1.f1_score(" ".join(answer), " ".join(truth))[0] + 0.01 * len(answer)


def clipped_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Truncated importance sampling at 2.0, Miles' TIS signature and return shape."""
    import torch

    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = ratio.clamp(max=2.0)
    metrics = {"custom_tis": ratio.detach(), "custom_tis_clipfrac": (weights != ratio).float()}
    return pg_loss * weights, loss_masks, metrics


def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """Miles' default log row, computed the way Miles' default computes it, plus a file of
    what the function was given; False: the default log row is still written."""
    log_dict = {**(rollout_extra_metrics or {})}
    lengths = [s.effective_response_length for s in samples]
    log_dict |= dict_add_prefix(compute_statistics(lengths), "rollout/response_len/")
    groups = group_by(samples, lambda s: s.group_index)
    rewards = [s.get_reward_value(args) for g in groups.values() for s in g]
    log_dict |= dict_add_prefix(compute_pass_rate(rewards, args.n_samples_per_prompt), "passrate/")
    log_dict["rollout/step"] = compute_rollout_step(args, rollout_id)
    tracking.log(args, log_dict, step_key="rollout/step")

    rows = [
        {
            "label": s.label,
            "loss_mask": s.loss_mask,
            "response_length": s.response_length,
            "turns": s.metadata.get("turns"),
            "reward": s.get_reward_value(args),
        }
        for s in samples
    ]
    with open(os.path.join(args.run_dir, "corpus_log.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"rollout_id": rollout_id, "samples": rows}) + "\n")
    return False
