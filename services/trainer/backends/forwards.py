"""The forwards of both backends over a step's micro-batches (loop.py `StepLoop` is built on
`Forwards`): per sample, the response tokens' logprobs (and entropies) under a model, the
critic's values, and before a rollout's first step the no-grad ones the estimator needs
(`prepare`: old policy, reference, critic, teacher) with the per-token advantages.

Logprobs are computed as the engine reports them (SGLang's default): log_softmax of the
logits divided by the rollout temperature (1 for greedy). Response token k of a sample whose
prompt has p tokens is tokens[p + k], predicted by the logits at position p + k - 1; the
critic's value for it is read at the same position (rows.py lays the micro-batch out). A
micro-batch is --micro-batch-size samples, or packed under --max-tokens-per-gpu with
--use-dynamic-batch-size (`_micro_batches`). The old policy: with one step per rollout it IS
the current one (nothing changes between computing it and the step), so old_logp =
logp.detach() and the ratio is exactly 1; with more, the logprobs recomputed before the first
step stay fixed for all steps.

What differs between the backends is the actor's forward (`_logits`: a Hugging Face causal
LM's here; the megatron backend's GPTModel builds its own masks) and whether the samples of a
micro-batch that share a prompt forward it once (`prompt_mask`, set from
`_shared_prompt_mask`: the torch backend probes its models, the megatron backend says none).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError

from ..algorithms.advantages import token_advantages
from ..algorithms.loss import approx_kl
from . import batching, chunked
from .base import TrainSample
from .critic import ValueModel
from .rows import (
    Inputs,
    at_least_fp32,
    pad,
    prompt_rows,
    row_layout,
    shared_prompt_layout,
    unpad,
    with_targets,
)


@dataclass
class Prepared:
    """Per sample of a slice (1-D tensors over its response tokens): what the loss needs
    beyond the samples. `old` is None when the ratio's old policy is the current one."""

    advantages: list[torch.Tensor]
    old: list[torch.Tensor] | None = None
    ref: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None  # ppo: the critic's targets
    values: list[torch.Tensor] | None = None  # ppo: the critic's values before the step

    def select(self, rows: list[int]) -> Prepared:
        def pick(xs: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if xs is None else [xs[i] for i in rows]

        return Prepared(
            [self.advantages[i] for i in rows], pick(self.old), pick(self.ref), pick(self.returns),
            pick(self.values),
        )  # fmt: skip


class Forwards:
    """The forwards; the state they read is the backend's (loop.py `StepLoop.__init__`)."""

    cfg: RunConfig
    device: torch.device
    temperature: float
    model: torch.nn.Module
    train_model: torch.nn.Module
    ref: torch.nn.Module | None
    teacher: torch.nn.Module | None
    critic: ValueModel | None
    prompt_mask: str | None
    context_parallel: int
    lockstep: Callable[[int], int]
    sum_across_ranks: Callable[[torch.Tensor], torch.Tensor]

    # -- inputs --------------------------------------------------------------------------------

    def _shared_prompt_mask(self) -> str | None:
        """`prompt_mask`: the kind of mask every model here takes for the shared-prompt layout
        (shared_prefix.py), or None: one row per sample (the torch backend probes its models)."""
        return None

    def _prompt_rows(self, samples: list[TrainSample]) -> list[list[int]] | None:
        """The groups of a micro-batch's samples that share a prompt, where the shared-prompt
        layout computes less (padded: a row per group; packed: one row of them)."""
        packed = self.cfg.perf.use_dynamic_batch_size
        return prompt_rows(samples, self.prompt_mask, self.model.config, packed)

    def _inputs(self, samples: list[TrainSample]) -> Inputs:
        """(model kwargs, (row_BT, col_BT) of each response token's predicting position,
        its target_BT, valid_BT), in the layout rows.py picks."""
        T = max(1, max(s.response_len for s in samples))
        packed = self.cfg.perf.use_dynamic_batch_size
        groups = self._prompt_rows(samples)
        if groups is not None:
            assert self.prompt_mask is not None
            dtype = next(self.model.parameters()).dtype
            layout = shared_prompt_layout(samples, groups, T, self.prompt_mask, packed, dtype)
        else:
            layout = row_layout(samples, T, packed)
        return with_targets(samples, T, layout, self.on_device)

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` where the models are (itself on the CPU)."""
        return x.to(self.device, non_blocking=True)

    def _padded(self, rows: list[list[float]] | list[torch.Tensor], T: int) -> torch.Tensor:
        """`pad(rows, T)` where the models are: what the loss reads beside the logprobs."""
        return self.on_device(pad(rows, T))

    def _micro_batches(self, samples: list[TrainSample]) -> list[list[int]]:
        """Indices of each micro-batch: by count, or packed by tokens (dynamic batching: as in
        Miles, a context parallel group shares its ranks' budgets, each holding a share of
        every sequence)."""
        p = self.cfg.perf
        if p.use_dynamic_batch_size:
            assert p.max_tokens_per_gpu is not None
            budget = p.max_tokens_per_gpu * self.context_parallel
            # With the shared-prompt layout, a prompt counts once per micro-batch.
            prompts = [tuple(s.tokens[: s.prompt_len]) for s in samples]
            return batching.pack_by_tokens(
                [len(s.tokens) for s in samples], budget, prompts if self.prompt_mask else None
            )
        size = p.micro_batch_size
        return [
            list(range(lo, min(lo + size, len(samples)))) for lo in range(0, len(samples), size)
        ]

    # -- forwards ------------------------------------------------------------------------------

    def _logprobs(
        self, model: torch.nn.Module, samples: list[TrainSample], with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(logp_BT, entropy_BT or None, valid_BT) over the response positions of each sample.
        With --log-probs-chunk-size C, a Hugging Face model's output layer runs on C response
        positions' hidden states at a time (`chunked.py`): the [positions, vocabulary] logits
        are never whole, in the forward or the backward."""
        inputs, (row_BT, col_BT), target_BT, valid_BT = self._inputs(samples)
        chunk = self.cfg.perf.log_probs_chunk_size
        if chunk > 0 and (head := chunked.output_layer(model)) is not None:
            hidden_BTH = chunked.final_hidden(model, inputs)[row_BT, col_BT]
            logp_BT, entropy_BT = chunked.token_logprobs(
                hidden_BTH, head, target_BT, self.temperature, chunk, with_entropy
            )
            return (
                logp_BT * valid_BT,
                None if entropy_BT is None else entropy_BT * valid_BT,
                valid_BT,
            )
        logits_BTV = at_least_fp32(self._logits(model, inputs)[row_BT, col_BT]) / self.temperature
        logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
        logp_BT = logp_BTV.gather(-1, target_BT[..., None]).squeeze(-1) * valid_BT
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1) * valid_BT if with_entropy else None
        return logp_BT, entropy_BT, valid_BT

    def _logits(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[R, S, V] logits of a Hugging Face causal LM for `_inputs`' model kwargs (the
        Megatron backend's actor answers differently)."""
        return model(**inputs).logits

    def _values(
        self, samples: list[TrainSample], critic: torch.nn.Module | None = None
    ) -> torch.Tensor:
        critic = critic or self.critic
        assert critic is not None
        inputs, (row_BT, col_BT), _, valid_BT = self._inputs(samples)
        return critic(**inputs)[row_BT, col_BT] * valid_BT

    @torch.no_grad()
    def _per_sample(
        self,
        forward: Callable[[list[TrainSample]], torch.Tensor],
        samples: list[TrainSample],
        model: torch.nn.Module | None = None,
    ) -> list[torch.Tensor]:
        """`forward` (-> x_BT) over the micro-batches training uses, split per sample, no grad
        (the same micro-batches, so a step's first forward gives the same numbers). `model`:
        the one `forward` runs, when it is the actor (kept in lockstep across ranks)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        micro_batches = self._micro_batches(samples)
        idle = self._rounds_owed(len(micro_batches)) if model is self.model else 0
        for rows in micro_batches:
            mb = [samples[i] for i in rows]
            for i, x in zip(rows, unpad(forward(mb).cpu(), mb), strict=True):
                out[i] = x
        self._idle_rounds(idle, backward=False)
        return out

    def _rounds_owed(self, real: int) -> int:
        """How many idle rounds this rank adds to its `real` forwards to keep the lockstep:
        asked before the first forward, since a sharded forward is a collective itself."""
        return self.lockstep(real) - real

    def _idle_rounds(self, n: int, *, backward: bool) -> None:
        """`n` forwards (and backwards) of a 1-token input whose loss is 0, so this rank joins
        the collectives of the ranks with more micro-batches."""
        for _ in range(n):
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            logits = self.train_model(input_ids=ids).logits
            if backward:
                (logits.sum() * 0.0).backward()

    def logprobs(
        self, samples: list[TrainSample], model: torch.nn.Module | None = None
    ) -> list[torch.Tensor]:
        """Per-sample response logprobs under `model` (default: the actor)."""
        model = model or self.model
        return self._per_sample(lambda mb: self._logprobs(model, mb, False)[0], samples, model)

    def values(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        """Per-sample critic values of the response tokens."""
        return self._per_sample(self._values, samples)

    # -- before the first step -----------------------------------------------------------------

    def prepare(self, slices: list[list[TrainSample]]) -> Prepared:
        """The no-grad forwards and per-token advantages for this rank's share of a rollout,
        given per step: forwards per step, with the micro-batches that step uses (so a step's
        first forward gives the same numbers); advantages over all steps at once (whitening
        sees the whole rollout)."""
        algo = self.cfg.algo
        kl_in_reward = algo.use_kl_in_reward and algo.kl_coef != 0
        need_old = len(slices) > 1 or kl_in_reward or algo.distills
        samples = [s for part in slices for s in part]

        def each_slice(fn: Callable[[list[TrainSample]], list[torch.Tensor]]) -> list[torch.Tensor]:
            return [x for part in slices for x in fn(part)]

        old = each_slice(self.logprobs) if need_old else None
        ref = None if self.ref is None else each_slice(lambda part: self.logprobs(part, self.ref))
        values = each_slice(self.values) if self.critic is not None else None
        teacher = None
        if algo.distills:
            if self.teacher is not None:
                teacher = each_slice(lambda part: self.logprobs(part, self.teacher))
            else:
                teacher = [torch.tensor(s.teacher_logprobs, dtype=torch.float32) for s in samples]
                for s, t in zip(samples, teacher, strict=True):
                    if len(t) != s.response_len:
                        raise MillstreamError(
                            f"a sample has {len(t)} teacher logprobs for {s.response_len} "
                            "response tokens: --opd-teacher-url must score every response token"
                        )
        T = max(1, max(s.response_len for s in samples))
        mask_BT = pad([s.loss_mask for s in samples], T)
        kl_BT = None
        if kl_in_reward:
            assert old is not None and ref is not None
            kl_BT = approx_kl(pad(old, T), pad(ref, T), algo.kl_loss_type)
        adv_BT, returns_BT = token_advantages(
            torch.tensor([s.reward for s in samples]), mask_BT, algo, kl_BT=kl_BT,
            values_BT=None if values is None else pad(values, T),
            student_BT=None if old is None else pad(old, T),
            teacher_BT=None if teacher is None else pad(teacher, T),
            sum_across_ranks=self.sum_across_ranks,
        )  # fmt: skip
        return Prepared(
            advantages=unpad(adv_BT, samples),
            old=old if len(slices) > 1 else None,
            ref=ref,
            returns=None if returns_BT is None else unpad(returns_BT, samples),
            values=values,
        )
