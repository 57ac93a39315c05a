"""The torch backend: a Hugging Face causal LM trained with a torch optimizer (and, for PPO,
a critic with its own optimizer).

Logprobs are computed as the engine reports them (SGLang's default): log_softmax of the
logits divided by the rollout temperature (1 for greedy). Response token k of a sample whose
prompt has p tokens is tokens[p + k], predicted by the logits at position p + k - 1; the
critic's value for it is read at the same position.

One rollout = `num_steps` optimizer steps over consecutive equal slices of the samples. Per
slice, each data-parallel rank takes its share (contiguous, or token-balanced with
--balance-data), and splits it into micro-batches (--micro-batch-size samples, or packed
under --max-tokens-per-gpu with --use-dynamic-batch-size: one row, position ids restarting
per sample). Samples of a micro-batch that share a prompt forward it once (shared_prefix.py)
where that computes less, for the same gradient. Before the first step, on every slice, `prepare` runs the no-grad forwards the
estimator needs (old policy, reference, critic, teacher) and computes per-token advantages.
The old policy: with one step per rollout it IS the current one (nothing changes between
computing it and the step), so old_logp = logp.detach() and the ratio is exactly 1; with
more, the logprobs recomputed before the first step stay fixed for all steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import clip_grad_norm_

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError

from ..algorithms.advantages import token_advantages
from ..algorithms.loss import Denominator, approx_kl, policy_loss, value_loss
from ..algorithms.tis import CustomTis, GroupInfo, ParallelState
from ..observe.profiler import TrainProfiler
from . import batching, chunked, shared_prefix
from .base import TrainSample
from .critic import ValueModel, load_value_model
from .precision import MasterWeights

log = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
CRITIC_DIR = "critic"


# What a forward takes: (model kwargs, (row_BT, col_BT), target_BT, valid_BT) (`_inputs`).
Inputs = tuple[
    dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor
]
# A micro-batch's layout (`_row_layout`, `_shared_prompt_layout`): model kwargs, and per
# sample its row and the T columns that predict its response tokens.
Layout = tuple[dict[str, torch.Tensor], list[int], list[list[int]]]


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


def lr_factor(step: int, cfg: RunConfig, total_steps: int) -> float:
    """Megatron-style schedule as a factor of --lr: linear warmup, then constant/linear/cosine decay."""
    o = cfg.optimizer
    warmup = o.lr_warmup_iters
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, (o.lr_decay_iters or total_steps) - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    floor = o.min_lr / o.lr
    if o.lr_decay_style == "linear":
        return floor + (1 - floor) * (1 - progress)
    if o.lr_decay_style == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


def fusable(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW (one pass over each tensor) can step `params`: plain
    floating-point tensors on the CPU or a GPU. Megatron steps with a fused Adam, and so does
    transformers' Trainer by default; torch's default (foreach) makes a pass per operation:
    17 ms against 4 ms a step for the 6.3M-parameter peer model on 2 cores. Sharded (DTensor)
    parameters keep torch's default."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point()
        for p in params
    )


def make_optimizer(
    params: list[torch.nn.Parameter], cfg: RunConfig, lr: float, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    o = cfg.optimizer
    optimizer: torch.optim.Optimizer
    if o.optimizer == "adam":
        optimizer = torch.optim.AdamW(
            params, lr=lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
            weight_decay=o.weight_decay, fused=fusable(params) or None,
        )  # fmt: skip
    else:
        optimizer = torch.optim.SGD(params, lr=lr, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )
    return optimizer, scheduler


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


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 for the softmax; fp32 and fp64 (the exactness tests) stay."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def pad(rows: list[list[float]] | list[torch.Tensor], T: int) -> torch.Tensor:
    """[len(rows), T] float32, each row zero-padded on the right: one tensor built at once
    (a copy per row cost ~10 us each, 5 ms of a small model's train step)."""
    if not rows:
        return torch.zeros(0, T)
    if all(isinstance(row, torch.Tensor) for row in rows):
        out = torch.zeros(len(rows), T)
        flat = torch.cat([row.reshape(-1).to(torch.float32) for row in rows])  # type: ignore[union-attr]
        lengths = torch.tensor([len(row) for row in rows])
        out[torch.arange(T)[None, :] < lengths[:, None]] = flat
        return out
    return torch.tensor([[*row, *([0.0] * (T - len(row)))] for row in rows], dtype=torch.float32)


def unpad(x_BT: torch.Tensor, samples: list[TrainSample]) -> list[torch.Tensor]:
    return [x_BT[i, : s.response_len].clone() for i, s in enumerate(samples)]


SHARD_FILE = "optimizer.rank{rank}.pt"  # --train-backend fsdp: each rank's optimizer shard


def sharded_optimizer_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(SHARD_FILE.format(rank="*")))


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


class TorchBackend:
    # Whether every data parallel rank takes part in a checkpoint's save (`save_shards`).
    collective_save = False
    # Whether its models may forward a micro-batch in the shared-prompt layout
    # (shared_prefix.py); the megatron backend's actor builds its own masks.
    shares_prompts = True
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
        self.model = load_causal_lm(actor_dir).to(self.device)  # the dtype once masters exist
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

    @functools.cached_property
    def custom_tis(self) -> CustomTis | None:
        """--custom-tis-function-path's function of the user's (with --use-tis), loaded at the
        first step, when this rank knows its place among the data parallel ranks."""
        algo = self.cfg.algo
        if not (algo.use_tis and algo.custom_tis_function):
            return None
        from millstream.common.config.store import without_secrets
        from millstream.common.miles import make_args

        ranks = ParallelState(intra_dp=GroupInfo(self.rank, self.world_size))
        args = make_args(without_secrets(self.cfg))
        return CustomTis(algo.custom_tis_function, args, ranks)

    def _frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model that only forwards (reference, teacher): on the device, in the actor's dtype."""
        return model.to(self.device, self.dtype).eval().requires_grad_(False)

    def _start_actor(self) -> None:
        """The actor's optimizer, then the actor in its dtype: the masters copy the
        checkpoint's fp32 weights before the cast to bf16 (the megatron backend builds its
        own actor and does the same with it)."""
        self.make_actor_optimizer()
        self.model.to(self.dtype)

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

    # -- forward -------------------------------------------------------------------------------

    def _shared_prompt_mask(self) -> str | None:
        """`prompt_mask`: the mask kind every model here takes, found by forwarding a probe
        both ways (a model whose attention drops a custom 4-D mask fails it), or None."""
        if not self.shares_prompts or self.cfg.perf.shared_prefix is False:
            return None
        models = [self.model, self.ref, self.teacher, self.critic]
        kinds = set()
        for model in models:
            if model is None:
                continue
            config = model.body.config if isinstance(model, ValueModel) else model.config
            impl = getattr(config, "_attn_implementation", None)
            kind = {"sdpa": "bool", "eager": "float"}.get(impl or "")
            if kind is None or not self._probe_shared_prompts(model, kind):
                log.info("one row per sample: %s (%s attention) takes no custom 4-D mask",
                         type(model).__name__, impl)  # fmt: skip
                return None
            kinds.add(kind)
        return kinds.pop() if len(kinds) == 1 else None

    def _probe_shared_prompts(self, model: torch.nn.Module, kind: str) -> bool:
        vocab = self.model.config.vocab_size
        prompt = [t % vocab for t in (5, 3, 7)]
        probe = [
            TrainSample(tokens=[*prompt, *(t % vocab for t in r)], prompt_len=3,
                        loss_mask=[1] * len(r), rollout_logprobs=[0.0] * len(r), reward=0.0)
            for r in ((2, 9, 4), (8,), (6, 1))
        ]  # fmt: skip
        rows = shared_prefix.group_by_prompt(probe)

        T = max(s.response_len for s in probe)

        def outputs(shared: bool) -> torch.Tensor:
            layout = (
                self._shared_prompt_layout(probe, rows, T, kind)
                if shared
                else self._row_layout(probe, T)
            )
            inputs, (row_BT, col_BT), _, valid_BT = self._on_device_with_targets(probe, T, layout)
            with torch.no_grad():
                out = model(**inputs)
            out = out if isinstance(out, torch.Tensor) else out.logits
            return out[row_BT, col_BT][valid_BT.bool()].float()

        training = model.training
        model.eval()  # no dropout: the two forwards must agree
        try:
            padded, shared = outputs(False), outputs(True)
        except Exception as err:  # a model that refuses the mask's shape or kind
            log.info("shared-prompt probe of %s failed: %s", type(model).__name__, err)
            return False
        finally:
            model.train(training)
        return torch.allclose(padded, shared, rtol=1e-3, atol=1e-3)

    def _prompt_rows(self, samples: list[TrainSample]) -> list[list[int]] | None:
        """The groups of a micro-batch's samples that share a prompt, where the shared-prompt
        layout computes less (padded: a row per group; packed: one row of them)."""
        if self.prompt_mask is None:
            return None
        groups = shared_prefix.group_by_prompt(samples)
        config = self.model.config
        hidden = config.hidden_size
        intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
        packed = self.cfg.perf.use_dynamic_batch_size
        pays = shared_prefix.cheaper(samples, groups, hidden, intermediate, packed)
        return groups if pays else None

    def _inputs(self, samples: list[TrainSample]) -> Inputs:
        """(model kwargs, (row_BT, col_BT) of each response token's predicting position,
        its target_BT, valid_BT). Padded: one row per sample, or one per prompt for samples
        that share it, where that computes less (shared_prefix.py). Packed (dynamic
        batching): all samples in one row, position ids restarting at each, which
        transformers turns into a block-diagonal causal mask; or each shared prompt once in
        that row, with its samples' responses after it (shared_prefix.py's mask)."""
        T = max(1, max(s.response_len for s in samples))
        groups = self._prompt_rows(samples)
        if groups is not None:
            assert self.prompt_mask is not None
            layout = self._shared_prompt_layout(samples, groups, T, self.prompt_mask)
        else:
            layout = self._row_layout(samples, T)
        return self._on_device_with_targets(samples, T, layout)

    def _row_layout(self, samples: list[TrainSample], T: int) -> Layout:
        """One row per sample (padded), or all of them in one row (packed)."""
        packed = self.cfg.perf.use_dynamic_batch_size
        lengths = [len(s.tokens) for s in samples]
        S = max(lengths)
        # Python lists first, one tensor each at the end (a tensor per sample is most of the
        # cost for small models).
        cols: list[list[int]] = []
        start = 0
        for s in samples:
            n, gap = len(s.tokens), T - s.response_len
            cols.append([*range(start + s.prompt_len - 1, start + n - 1), *([0] * gap)])
            if packed:
                start += n
        rows = [0] * len(samples) if packed else list(range(len(samples)))
        if packed:
            ids = [t for s in samples for t in s.tokens]
            pos = [j for n in lengths for j in range(n)]
            inputs = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos])}
        else:
            ids_RS = torch.tensor([[*s.tokens, *([0] * (S - len(s.tokens)))] for s in samples])
            attn_RS = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
            inputs = {"input_ids": ids_RS, "attention_mask": attn_RS}
        return inputs, rows, cols

    def _shared_prompt_layout(
        self, samples: list[TrainSample], groups: list[list[int]], T: int, kind: str
    ) -> Layout:
        lay = shared_prefix.layout(samples, groups, T, self.cfg.perf.use_dynamic_batch_size)
        dtype = next(self.model.parameters()).dtype if kind == "float" else None
        inputs = {
            "input_ids": torch.tensor(lay.ids),
            "position_ids": torch.tensor(lay.positions),
            "attention_mask": lay.mask(dtype),
        }
        return inputs, lay.row_of, lay.cols

    def _on_device_with_targets(self, samples: list[TrainSample], T: int, layout: Layout) -> Inputs:
        """A layout's tensors where the models are, with each sample's response tokens as
        targets and which of its T positions are real: the same whatever the layout."""
        inputs, rows, cols = layout
        targets = [[*s.tokens[s.prompt_len :], *([0] * (T - s.response_len))] for s in samples]
        valid = [[1.0] * s.response_len + [0.0] * (T - s.response_len) for s in samples]
        row_BT = torch.tensor(rows)[:, None].expand(len(samples), T).contiguous()
        on = self.on_device
        return (
            {name: on(x) for name, x in inputs.items()},
            (on(row_BT), on(torch.tensor(cols))),
            on(torch.tensor(targets)),
            on(torch.tensor(valid)),
        )

    def on_device(self, x: torch.Tensor) -> torch.Tensor:
        """`x` where the models are (itself on the CPU)."""
        return x.to(self.device, non_blocking=True)

    def _padded(self, rows: list[list[float]] | list[torch.Tensor], T: int) -> torch.Tensor:
        """`pad(rows, T)` where the models are: what the loss reads beside the logprobs."""
        return self.on_device(pad(rows, T))

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

    # -- splitting -----------------------------------------------------------------------------

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

    def _my_share(self, samples: list[TrainSample]) -> list[int]:
        """Indices of this rank's share of a step's samples (the same split on every rank)."""
        if self.cfg.perf.balance_data and self.world_size > 1:
            lengths = [len(s.tokens) for s in samples]
            return batching.balance_across_ranks(lengths, self.world_size)[self.rank]
        return batching.contiguous_shards(len(samples), self.world_size)[self.rank]

    # -- training ------------------------------------------------------------------------------

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

    # -- weights and checkpoints ---------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.full_weights is not None:  # sharded: what the last gather collected
            yield from self.full_weights.items()
            return
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def save_shards(self, directory: Path, save_optimizer: bool = True) -> None:
        """What a rank other than 0 writes into a checkpoint, where the backend saves
        collectively (`collective_save`): nothing here."""

    def save(
        self, directory: Path, save_optimizer: bool = True, *, actor_optimizer: bool = True
    ) -> None:
        """The actor in Hugging Face format (the gathered full weights when sharded), its
        optimizer (`actor_optimizer=False`: the caller writes it, sharded), the critic."""
        self.model.save_pretrained(
            directory / "model", state_dict=self.full_weights, safe_serialization=True
        )
        if self.model.dtype != self.dtype:  # FSDP's --bf16: fp32 shards, bf16 weights gathered
            self.model.config.dtype = str(self.dtype).removeprefix("torch.")
            self.model.config.save_pretrained(directory / "model")
        if save_optimizer and actor_optimizer:
            state = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            if self.master is not None:  # --bf16: the fp32 weights model/ rounds
                state |= self.master.state_dict()
            torch.save(state, directory / OPTIMIZER_FILE)
        if self.critic is not None:
            critic_dir = directory / CRITIC_DIR
            self.critic.save(critic_dir)
            if save_optimizer:
                torch.save(
                    {
                        "optimizer": self.critic_optimizer.state_dict(),
                        "scheduler": self.critic_scheduler.state_dict(),
                    },
                    critic_dir / OPTIMIZER_FILE,
                )

    def load_weights(self, directory: Path) -> None:
        """The actor's weights from a checkpoint (before FSDP shards them)."""
        from safetensors.torch import load_model

        load_model(self.model, str(directory / "model" / "model.safetensors"), strict=False)
        if self.master is not None:  # until the optimizer's state brings the fp32 ones
            self.master.from_model()

    def load(self, directory: Path, load_optimizer: bool = True, *, actor: bool = True) -> None:
        """A checkpoint's actor (`actor=False`: loaded already, and its optimizer is the
        caller's), its optimizer, the critic."""
        opt_path = directory / OPTIMIZER_FILE
        if actor:
            self.load_weights(directory)
            if load_optimizer and not opt_path.is_file() and sharded_optimizer_files(directory):
                n = len(sharded_optimizer_files(directory))
                raise MillstreamError(
                    f"{directory}: the optimizer state is sharded over {n} ranks (FSDP or "
                    "tensor parallel): resume with the same --train-backend and parallel sizes "
                    f"under torchrun --nproc-per-node {n}, or pass --no-load-optim"
                )
        if actor and load_optimizer and opt_path.is_file():
            state = torch.load(opt_path, weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            if self.master is not None and "master" in state:
                self.master.load_state_dict(state)
        critic_dir = directory / CRITIC_DIR
        if self.critic is not None and critic_dir.is_dir():
            self.critic.load(critic_dir)
            opt_path = critic_dir / OPTIMIZER_FILE
            if load_optimizer and opt_path.is_file():
                state = torch.load(opt_path, weights_only=True)
                self.critic_optimizer.load_state_dict(state["optimizer"])
                self.critic_scheduler.load_state_dict(state["scheduler"])
