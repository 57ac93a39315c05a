"""The step loop both backends are built on: `StepLoop`, which the torch backend
(torch_backend.py: a Hugging Face actor) and the megatron backend (megatron/backend.py:
megatron-core's GPTModel as the actor) each complete with their actor.

One rollout = `num_steps` optimizer steps over consecutive equal slices of the samples. Per
slice, each data-parallel rank takes its share (contiguous, or token-balanced with
--balance-data), and splits it into micro-batches (forwards.py). Before the first step, on
every slice, `prepare` runs the no-grad forwards the estimator needs and computes per-token
advantages (forwards.py); then each step accumulates the policy loss's gradients over the
micro-batches (and the critic's, for PPO), clips and steps the actor's optimizer (optim.py,
over --bf16's fp32 masters: precision.py) and the critic's.

Besides the actor, both backends hold the same models: a Hugging Face reference and teacher
(forward only) and PPO's critic (critic.py), built here; `_start_actor` is the backend's. What
a checkpoint holds is saving.py's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import clip_grad_norm_

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError

from ..algorithms.loss import Denominator, policy_loss, value_loss
from ..algorithms.tis import CustomTis, GroupInfo, ParallelState
from ..observe.profiler import TrainProfiler
from . import batching
from .base import TrainSample
from .critic import ValueModel, load_value_model
from .forwards import Forwards, Prepared
from .optim import make_optimizer
from .precision import MasterWeights
from .saving import Checkpoints

log = logging.getLogger(__name__)


def load_causal_lm(path: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not Path(path, "config.json").is_file():
        raise MillstreamError(
            f"{path} is not a Hugging Face model dir (no config.json): check --hf-checkpoint / --load"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def train_device() -> torch.device:
    """Where the trainer computes: this process's GPU when torch sees one (torchrun's
    LOCAL_RANK picks it, backends/distributed.py), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _value(x: torch.Tensor) -> float:
    """A scalar tensor's value; a DTensor's (FSDP) is gathered first."""
    full = getattr(x, "full_tensor", None)
    return float(full() if full is not None else x)


def _last_synced(
    model: torch.nn.Module, micro_batches: list[list[int]]
) -> Iterator[tuple[list[int], contextlib.AbstractContextManager[Any]]]:
    """Each micro-batch with the context its forward and backward run in: under torch's
    DistributedDataParallel, `no_sync()` for all but the last, whose backward sums the
    accumulated gradients across ranks (once per step on every rank, however many
    micro-batches each has); nothing to do for a plain module."""
    last = len(micro_batches) - 1
    for k, rows in enumerate(micro_batches):
        no_sync = getattr(model, "no_sync", None)
        yield rows, (no_sync() if no_sync is not None and k < last else contextlib.nullcontext())


class StepLoop(Forwards, Checkpoints):
    # A checkpoint the actor's weights came from instead of its model dir (the megatron
    # backend's torch_dist --load or --ref-load): the engines get them before the first rollout.
    start_checkpoint: Path | None = None

    def __init__(
        self,
        cfg: RunConfig,
        actor_dir: str | Path,
        *,
        ref_dir: str | Path | None,
        total_steps: int,
        critic_dir: str | Path | None = None,
        teacher_dir: str | Path | None = None,
    ):
        torch.manual_seed(cfg.ckpt.seed)
        self.cfg = cfg
        self.temperature = cfg.rollout.logprob_temperature
        # The models and every forward's inputs live here; what `prepare` keeps between the
        # forwards (logprobs, advantages) stays on the CPU, moved in per micro-batch.
        self.device = train_device()
        # --bf16: the models compute in bf16, the optimizer steps fp32 masters (precision.py):
        # MasterWeights beside the actor's bf16 parameters (`keeps_masters`), except under
        # FSDP's mixed precision, whose fp32 shards are the masters (backends/distributed.py).
        self.dtype = torch.bfloat16 if cfg.perf.bf16 else torch.float32
        self.keeps_masters = self.dtype != torch.float32
        self.master: MasterWeights | None = None
        # The actor as a Hugging Face model (the megatron backend's skeleton, whose weights
        # its GPTModel takes); in the dtype once masters exist (`_start_actor`).
        self.model = load_causal_lm(actor_dir).to(self.device)
        self.model.train()
        self.ref = None
        if ref_dir:
            self.ref = self._frozen(load_causal_lm(ref_dir))
        self.teacher = None
        if teacher_dir:
            self.teacher = self._frozen(load_causal_lm(teacher_dir))
        self.total_steps = total_steps
        self._start_actor()
        self.critic: ValueModel | None = None
        if critic_dir is not None:
            self.critic = load_value_model(critic_dir).to(self.device)
            self.critic.train()
            self.critic_optimizer, self.critic_scheduler = make_optimizer(
                list(self.critic.parameters()), cfg, cfg.algo.critic_lr or cfg.optimizer.lr,
                total_steps,
            )  # fmt: skip
        # How this backend lays out a padded micro-batch's prompts: shared by the samples that
        # have the same one (shared_prefix.py) when every model here takes the layout (as
        # `attention_mask`, of this kind: "bool" or an additive float mask), else None.
        self.prompt_mask: str | None = self._shared_prompt_mask()
        # Set by DataParallel: this rank's place; the models the gradient forwards run through
        # (torch's DistributedDataParallel around model and critic, which sums the gradients
        # across ranks in the backward of each step's last micro-batch); the sum across ranks
        # of the per-shard metric sums; the sum of a tensor (whitening statistics).
        self.rank, self.world_size = 0, 1
        self.tensor_parallel = 1  # ranks that split each layer (megatron/backend.py sets it)
        # ranks that hold one copy of the model between them: tensor x pipeline x context
        # parallel; the context parallel ones share each sequence (megatron/backend.py)
        self.model_parallel = self.context_parallel = 1
        self.train_model: torch.nn.Module = self.model
        # Whether train_model sums the actor's gradients over the data parallel ranks itself
        # (megatron's DistributedDataParallel), so DataParallel leaves it unwrapped.
        self.sums_own_gradients = False
        # With --bf16 over several data parallel ranks, set by DataParallel in place of DDP:
        # sums the masters' fp32 gradients over them after each step's backward.
        self.sum_master_gradients: Callable[[], None] | None = None
        self.train_critic: torch.nn.Module | None = self.critic
        # With --train-backend fsdp (DataParallel shards the actor): every forward of the actor
        # is a collective, so each rank runs as many as the rank with the most micro-batches
        # (`lockstep`: n -> the max over ranks; the extra ones are idle 1-token rounds), and the
        # full weights rank 0 syncs and saves are gathered after every rollout (`full_weights`).
        self.lockstep: Callable[[int], int] = lambda n: n
        self.full_weights: dict[str, torch.Tensor] | None = None
        self.reduce_across_ranks: Callable[[dict[str, float]], dict[str, float]] | None = None
        self.sum_across_ranks: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.step_metrics: list[dict[str, float]] = []  # the last rollout's, one per step
        # --use-pytorch-profiler / --memory-snapshot-path: set by the build (rank 0), else off.
        self.profiler = TrainProfiler()

    def _start_actor(self) -> None:
        """The actor and its optimizer, after the reference and teacher load: each backend's."""
        raise NotImplementedError

    @functools.cached_property
    def custom_tis(self) -> CustomTis | None:
        """--custom-tis-function-path's function of the user's (with --use-tis), loaded at the
        first step, when this rank knows its place among the data parallel ranks."""
        algo = self.cfg.algo
        if not (algo.use_tis and algo.custom_tis_function):
            return None
        from millstream.common.config.store import without_secrets
        from millstream.compat.miles import make_args

        ranks = ParallelState(intra_dp=GroupInfo(self.rank, self.world_size))
        args = make_args(without_secrets(self.cfg))
        return CustomTis(algo.custom_tis_function, args, ranks)

    def _frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model that only forwards (reference, teacher): on the device, in the actor's dtype."""
        return model.to(self.device, self.dtype).eval().requires_grad_(False)

    def make_actor_optimizer(self) -> None:
        """The actor's optimizer and schedule over its parameters as they are now (again after
        FSDP sharding replaced them); with --bf16 over their fp32 masters, copied from them
        as they are (the checkpoint's fp32 weights, before the model is cast to bf16)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.keeps_masters:
            if self.master is not None:
                self.master.remove()
            self.master = MasterWeights(params)
            params = self.master.params
        self.optimizer, self.scheduler = make_optimizer(
            params, self.cfg, self.cfg.optimizer.lr, self.total_steps
        )

    def data_parallel_group(self) -> Any:
        """The process group whose ranks split the samples and sum their gradients (None: all
        of them; megatron's tensor parallel ranks share their samples)."""
        return None

    def grad_param(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        """The parameter whose `.grad` holds an actor parameter's gradient at the step: its
        fp32 master with --bf16 (the hooks moved it there), else itself."""
        return param if self.master is None else self.master.master_of(param)

    def clip_actor_gradients(self, max_norm: float) -> float:
        """The actor's gradient norm (before clipping), its gradients clipped to `max_norm`
        (with --bf16, the fp32 gradients of its masters)."""
        params = self.master.params if self.master is not None else self.model.parameters()
        return _value(clip_grad_norm_(params, max_norm))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter a step updates (actor, then critic): DataParallel sums their grads."""
        models = [self.model] + ([self.critic] if self.critic is not None else [])
        return [p for m in models for p in m.parameters() if p.requires_grad]

    def _my_share(self, samples: list[TrainSample]) -> list[int]:
        """Indices of this rank's share of a step's samples (the same split on every rank)."""
        if self.cfg.perf.balance_data and self.world_size > 1:
            lengths = [len(s.tokens) for s in samples]
            return batching.balance_across_ranks(lengths, self.world_size)[self.rank]
        return batching.contiguous_shards(len(samples), self.world_size)[self.rank]

    # -- training ------------------------------------------------------------------------------

    def train_rollout(
        self, samples: list[TrainSample], num_steps: int, rollout_id: int = 0
    ) -> dict[str, float]:
        """`num_steps` optimizer steps over consecutive equal slices of the samples."""
        with self.profiler.target("train_overall", rollout_id):
            return self._train_rollout(samples, num_steps, rollout_id)

    def _train_rollout(
        self, samples: list[TrainSample], num_steps: int, rollout_id: int
    ) -> dict[str, float]:
        if len(samples) % num_steps:
            raise ValueError(f"{len(samples)} samples do not split into {num_steps} equal steps")
        per_step = len(samples) // num_steps
        if per_step < self.world_size:
            raise ValueError(
                f"{per_step} samples per step cannot be shared by {self.world_size} trainer ranks"
            )
        steps = [samples[k * per_step : (k + 1) * per_step] for k in range(num_steps)]
        shares = [[step[i] for i in self._my_share(step)] for step in steps]
        with self.profiler.target("train_log_probs", rollout_id):
            prepared = self.prepare(shares)
        critic_only = rollout_id < self.cfg.algo.num_critic_only_steps and self.critic is not None
        totals: dict[str, float] = defaultdict(float)
        self.step_metrics = []
        offset = 0
        with self.profiler.target("train_actor", rollout_id):
            for step, share in zip(steps, shares, strict=True):
                rows = list(range(offset, offset + len(share)))
                offset += len(share)
                step_metrics = self._step(step, share, prepared.select(rows), critic_only)
                self.step_metrics.append(step_metrics)
                for name, value in step_metrics.items():
                    totals[name] += value / num_steps
        return dict(totals)

    def _step(
        self,
        step_samples: list[TrainSample],
        samples: list[TrainSample],
        prepared: Prepared,
        critic_only: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over `step_samples` (the whole slice, for the denominators);
        this rank trains on `samples`, its share, with `prepared` for them."""
        self.optimizer.zero_grad(set_to_none=True)
        denom = Denominator(
            n_samples=len(step_samples),
            n_tokens=max(1, sum(sum(s.loss_mask) for s in step_samples)),
        )
        metrics: dict[str, float] = {}
        if not critic_only:
            metrics |= self.accumulate_gradients(samples, prepared, denom)
            if self.sum_master_gradients is not None:
                self.sum_master_gradients()
        if self.critic is not None:
            self.critic_optimizer.zero_grad(set_to_none=True)
            metrics |= self.accumulate_critic_gradients(samples, prepared, denom)
        if self.reduce_across_ranks is not None:
            metrics = self.reduce_across_ranks(metrics)
        clip = self.cfg.optimizer.clip_grad
        max_norm = clip if clip > 0 else float("inf")
        if not critic_only:
            metrics |= self.actor_step(max_norm)
        if self.critic is not None:
            metrics["critic_grad_norm"] = float(clip_grad_norm_(self.critic.parameters(), max_norm))
            metrics["critic_lr"] = self.critic_optimizer.param_groups[0]["lr"]
            self.critic_optimizer.step()
            self.critic_scheduler.step()
        return metrics

    def actor_step(self, max_norm: float) -> dict[str, float]:
        """Clip the actor's gradients to `max_norm`, step its optimizer and schedule: the
        norm before clipping and the learning rate of the step."""
        metrics: dict[str, float] = {}  # (as assignments: test_tracking.py reads them)
        metrics["grad_norm"] = self.clip_actor_gradients(max_norm)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        if self.master is not None:
            self.master.to_model()
        return metrics

    def accumulate_gradients(
        self, samples: list[TrainSample], prepared: Prepared, denom: Denominator | None = None
    ) -> dict[str, float]:
        """Backward of the policy loss over micro-batches; the summed gradient is the gradient
        of the loss over the slice `denom` counts (by default, `samples` itself)."""
        denom = denom or Denominator(
            n_samples=len(samples), n_tokens=max(1, sum(sum(s.loss_mask) for s in samples))
        )
        metrics: dict[str, float] = defaultdict(float)
        micro_batches = self._micro_batches(samples)
        idle = self._rounds_owed(len(micro_batches))
        for rows, synced in _last_synced(self.train_model, micro_batches):
            mb, p = [samples[i] for i in rows], prepared.select(rows)
            with synced:
                logp_BT, entropy_BT, valid_BT = self._logprobs(self.train_model, mb, True)
                T = logp_BT.shape[1]
                scored_BT = logp_BT.detach() if p.old is None else self._padded(p.old, T)
                rollout_BT = self._padded([s.rollout_logprobs for s in mb], T)
                loss, mb_metrics = policy_loss(
                    logp_BT,
                    rollout_BT if self.cfg.algo.use_rollout_logprobs else scored_BT,
                    self._padded(p.advantages, T),
                    self._padded([s.loss_mask for s in mb], T) * valid_BT,
                    self.cfg.algo,
                    denom,
                    rollout_logp_BT=rollout_BT,
                    ref_logp_BT=None if p.ref is None else self._padded(p.ref, T),
                    entropy_BT=entropy_BT,
                    scored_logp_BT=scored_BT,
                    custom_tis=self.custom_tis,
                    lengths=([s.response_len for s in mb], [len(s.tokens) for s in mb]),
                )
                loss.backward()
            metrics["loss"] += loss.item()
            for name, value in mb_metrics.items():
                metrics[name] += value
        self._idle_rounds(idle, backward=True)
        return dict(metrics)

    def accumulate_critic_gradients(
        self, samples: list[TrainSample], prepared: Prepared, denom: Denominator
    ) -> dict[str, float]:
        assert prepared.returns is not None and prepared.values is not None
        metrics: dict[str, float] = defaultdict(float)
        critic = self.train_critic or self.critic
        assert critic is not None
        for rows, synced in _last_synced(critic, self._micro_batches(samples)):
            mb, p = [samples[i] for i in rows], prepared.select(rows)
            with synced:
                values_BT = self._values(mb, critic)
                T = values_BT.shape[1]
                loss, mb_metrics = value_loss(
                    values_BT, self._padded(p.values, T), self._padded(p.returns, T),
                    self._padded([s.loss_mask for s in mb], T), self.cfg.algo, denom,
                )  # fmt: skip
                loss.backward()
            for name, value in mb_metrics.items():
                metrics[name] += value
        return dict(metrics)
