"""`--custom-generate-function-path`: Miles' per-sample generate, run as the group's rollout.

Miles calls `await custom_generate(args, sample, sampling_params) -> Sample` once per sample
inside its default rollout; the function talks to the engines itself, through the router at
`http://{args.sglang_router_ip}:{args.sglang_router_port}` (SGLang's /generate, as millstream's
engines and router speak it), and fills in the sample: `tokens` (prompt + response),
`response`, `response_length`, `rollout_log_probs`, `loss_mask`, `status`. Here
`MilesGenerate` is the group's rollout function: it makes the group's n samples as Miles'
data source does (the prompt, its tokens, label and metadata; `index` 0..n-1), calls the
function for all of them at once, and sends what comes back on as the SampleGroup. A sync
function runs in a thread. `sampling_params` is the group's (rollout_temperature, top_p,
top_k, max_new_tokens, stop, ...; the eval ones for an eval group) without `n`, as Miles
passes them. A function may return a list of Samples (Miles' multi-sample form): all of them
are kept.

A sample that comes back ABORTED (a weight sync aborted its request; Miles' `generate` maps
finish_reason abort to it) is never trained on as it is: as the default rollout does
(rollout/group.py), the group parks in the worker's partial buffer until the sync looks over,
then the function is called again with the sample: with `--partial-rollout` as it stands
(Miles' resume: the function continues from `sample.tokens`;
`--mask-offpolicy-in-partial-rollout` first masks the old part out of the loss, as Miles'
`generate_and_rm` does), without it from a fresh copy of the sample. After `max_aborts`
aborts it is published as aborted.

`args` is Miles' (compat/miles/) with `sglang_router_ip` and `sglang_router_port` set to the
router this worker uses. Miles' `miles.utils.http_utils.post(url, payload)` is stood in for
(compat/miles/ `http_post`), so a function that imports it runs as it is. An exception in
the function, or an answer that is no Sample, is a plugin's bug: the group fails at once with
the error and its traceback (common/plugin_errors.py, rollout/worker.py), never retried. A
failure to reach the router (an HTTP or connection error, after `http_post`'s own retries)
is the router's: the group fails as GenerationFailed, as with the default rollout.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from typing import Any
from urllib.parse import urlsplit

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError
from millstream.common.plugin_errors import PluginFailed, is_infrastructure, reraise
from millstream.common.types import PromptGroup, SampleGroup
from millstream.compat.miles import Args, Sample, is_async, make_args, sample_to_pb
from millstream.compat.plugins import load_function

from .client import GenerationFailed, RouterClient
from .config import plan_for
from .partial import PartialBuffer

log = logging.getLogger("millstream.rollout")

FLAG = "--custom-generate-function-path"


def router_args(cfg: RunConfig, router_url: str) -> Args:
    """Miles' args, with the router this worker uses as sglang_router_ip/port."""
    parts = urlsplit(router_url)
    values = make_args(cfg).to_dict()
    values["sglang_router_ip"] = parts.hostname
    values["sglang_router_port"] = parts.port or (443 if parts.scheme == "https" else 80)
    return Args(values)


class MilesGenerate:
    """The rollout function for a --custom-generate-function-path (see the module docstring)."""

    def __init__(
        self,
        path: str,
        cfg: RunConfig,
        router_url: str,
        buffer: PartialBuffer | None = None,
        *,
        max_aborts: int = 8,
    ):
        self.path = path
        self.fn = load_function(path, FLAG)
        self.args = router_args(cfg, router_url)
        self.buffer = buffer
        self.partial = cfg.rollout.partial_rollout
        self.mask_offpolicy = cfg.rollout.mask_offpolicy_in_partial_rollout
        self.max_aborts = max_aborts

    async def __call__(
        self, group: PromptGroup, cfg: RunConfig, client: RouterClient
    ) -> SampleGroup:
        plan = plan_for(group, cfg)
        params = {k: v for k, v in plan.sampling_params.items() if k != "n"}
        metadata = json.loads(group.metadata_json) if group.metadata_json else {}
        samples = [
            Sample(
                group_index=group.data_index,
                index=i,
                prompt=group.prompt_text,
                tokens=list(group.prompt_token_ids),
                label=json.loads(group.label_json) if group.label_json else group.label,
                metadata=dict(metadata),
                group_id=group.group_id,
            )
            for i in range(plan.n_samples)
        ]
        current: list[Sample | list[Sample]] = list(samples)  # where each sample stands

        def snapshot() -> PromptGroup:
            view = PromptGroup()
            view.CopyFrom(group)
            view.ClearField("partial_samples")
            for one in current:
                view.partial_samples.extend(sample_to_pb(s) for s in _as_list(one))
            return view

        results = await asyncio.gather(
            *(self._one(i, s, params, current, snapshot) for i, s in enumerate(samples))
        )
        out = SampleGroup(prompt=group)
        for result in results:
            for sample in _as_list(result):
                if not isinstance(sample, Sample):
                    raise TypeError(
                        f"{FLAG} {self.path} returned {type(sample).__name__}, not a Sample"
                    )
                sample.group_id = group.group_id
                out.samples.append(sample_to_pb(sample))
        return out

    async def _one(
        self,
        i: int,
        fresh: Sample,
        params: dict[str, Any],
        current: list[Sample | list[Sample]],
        snapshot: Any,
    ) -> Sample | list[Sample]:
        sample, aborts = copy.deepcopy(fresh), 0
        while True:
            result = current[i] = await self._call(sample, dict(params))
            if not isinstance(result, Sample) or result.status != Sample.Status.ABORTED:
                return result
            aborts += 1
            if self.buffer is None or aborts > self.max_aborts:
                log.warning(
                    "sample %d of group %s aborted %d times; published as aborted",
                    i,
                    fresh.group_id,
                    aborts,
                )
                return result
            await self.buffer.wait(fresh.group_id, snapshot)
            if not self.partial:  # start over from the prompt
                sample = copy.deepcopy(fresh)
                continue
            sample = result
            if self.mask_offpolicy and sample.response_length > 0:
                sample.loss_mask = [0] * sample.response_length

    async def _call(self, sample: Sample, params: dict[str, Any]) -> Sample | list[Sample]:
        """The function's Sample(s); PluginFailed when it raises (the router's failures,
        after http_post's own retries, are GenerationFailed) or returns anything else."""
        try:
            if is_async(self.fn):
                result = await self.fn(self.args, sample, params)
            else:
                result = await asyncio.to_thread(self.fn, self.args, sample, params)
        except Exception as err:
            if is_infrastructure(err) and not isinstance(err, MillstreamError):
                raise GenerationFailed(f"{FLAG} {self.path}: {type(err).__name__}: {err}") from err
            reraise(err, FLAG, self.path, "rollout")
        if not all(isinstance(s, Sample) for s in _as_list(result)):
            wrong = TypeError(f"returned {result!r:.200}: expected a Sample or a list of Samples")
            raise PluginFailed.of(wrong, FLAG, self.path, "rollout")
        return result


def _as_list(result: Sample | list[Sample]) -> list[Sample]:
    return result if isinstance(result, list) else [result]
