"""--train-backend megatron: the step loop both backends share (loop.py) with megatron-core's
GPTModel as the actor (issue 15): one rank, data parallel, tensor parallel
(--tensor-model-parallel-size), pipeline parallel (--pipeline-model-parallel-size,
megatron/pipeline.py) and context parallel (--context-parallel-size, megatron/context.py) under
torchrun, in any combination (the world a multiple of TP x PP x CP, the rest data parallel).

Everything but the actor is the step loop's (loop.py, forwards.py, saving.py), as it is the
torch backend's: the batching, the no-grad forwards, the advantages, the loss code, the
optimizer (optim.py) and the checkpoint files are shared, not copied; the reference and teacher
models stay Hugging Face models (forward only), and so does PPO's critic (critic.py's value
model, trained whole on every rank: tensor parallelism does not split it). The actor is built
from the checkpoint's config.json and weights (megatron/model.py) and trained with the same
plain torch optimizer, or on GPUs with --use-distributed-optimizer under megatron's
DistributedDataParallel with its distributed optimizer (megatron/optimizer.py). Its forward gets right-padded rows with
megatron's default causal mask (padding only follows a row's tokens, so it changes nothing
the loss reads), or, packed (--use-dynamic-batch-size), one row with a block-diagonal causal
mask built from the position ids. Weights leave in Hugging Face names and layouts
(`named_weights` for the weight sync, `save` for checkpoints), and `load_weights` reads them.

megatron needs a default process group and its parallel state: a bare trainer process gets a
one-rank gloo group (`one_rank_group`); under torchrun it is torchrun's, split by megatron
into tensor parallel groups of --tensor-model-parallel-size consecutive ranks and data
parallel groups across them. The ranks of a tensor parallel group get the same samples and
run every forward and backward together (megatron's layers all-reduce inside); the data
parallel groups train as the torch backend's ranks do (backends/distributed.py: DDP over
`data_parallel_group`, when it has more than one rank). With tensor parallelism the gradient
norm sums each split parameter's slices over the group (`clip_actor_gradients`), and the
whole weights are gathered by every rank after each rollout, rank 0 keeping them for weight
syncs and checkpoints (`gather_weights`).

--bf16 (backends/precision.py): megatron's TransformerConfig(bf16=True) and the GPTModel cast
to bf16 after its fp32 weights are loaded and copied into the fp32 masters (megatron/model.py),
which the plain torch optimizer steps as the torch backend's does. megatron's own fp32-master
optimizers cannot run on CPU (Float16OptimizerWithFloat16Params makes its unit loss scale with
device="cuda" and accepts only torch.cuda tensor types; its distributed optimizer needs
megatron's DistributedDataParallel, whose buffers are CUDA's), and --use-distributed-optimizer
with --bf16 on a GPU is refused (not built). The gradient sums over the tensor, pipeline and
context parallel groups and the clipping read each parameter's gradient on its master
(`grad_param`); the weights leave in bf16.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError
from millstream.trainer.checkpoints import megatron_ckpt

from ..loop import StepLoop
from . import dist as megatron_dist
from . import model as megatron_model
from . import optimizer as megatron_optimizer
from . import pipeline as megatron_pipeline

log = logging.getLogger(__name__)


def one_rank_group() -> None:
    """The default process group megatron's parallel state hangs on, for a bare process."""
    import torch.distributed as dist

    if not dist.is_initialized():  # with a GPU, NCCL for its tensors (megatron's gradients)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, S, S] True where attention is masked, for one packed row whose position ids
    restart at 0 at each sample: causal, and never across samples."""
    sample_of = torch.cumsum((position_ids[0] == 0).long(), dim=0)
    S = sample_of.numel()
    future = torch.ones(S, S, dtype=torch.bool, device=position_ids.device).triu(1)
    other = sample_of[:, None] != sample_of[None, :]
    return (future | other)[None, None]


class MegatronBackend(StepLoop):
    collective_save = True  # torch_dist: every rank writes its slices (backends/distributed.py)
    # No shared-prompt layout (`prompt_mask` stays None): its actor's forward builds its own
    # masks (`_logits`).

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
        if cfg.perf.bf16 and cfg.megatron.use_distributed_optimizer and torch.cuda.is_available():
            raise MillstreamError(
                "--bf16 with --use-distributed-optimizer on a GPU is not built yet (megatron's "
                "distributed optimizer keeping the fp32 masters): drop --use-distributed-"
                "optimizer to step fp32 masters with the plain optimizer, or drop --bf16"
            )
        super().__init__(
            cfg, actor_dir, ref_dir=ref_dir, total_steps=total_steps, critic_dir=critic_dir,
            teacher_dir=teacher_dir,
        )  # fmt: skip
        self.hf = self.model.requires_grad_(False)  # its config; the skeleton checkpoints use
        m = cfg.megatron
        self.tensor_parallel = m.tensor_model_parallel_size
        self.pipeline_parallel = m.pipeline_model_parallel_size
        self.context_parallel = m.context_parallel_size
        self.model_parallel = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        one_rank_group()
        init_model_parallel(self.tensor_parallel, self.pipeline_parallel, self.context_parallel)
        recompute = {"granularity": m.recompute_granularity, "method": m.recompute_method,
                     "num_layers": m.recompute_num_layers}  # fmt: skip
        bf16 = self.dtype == torch.bfloat16
        # Miles (Megatron-LM) turns --sequence-parallel off with one tensor parallel rank.
        self.sequence_parallel = m.sequence_parallel and self.tensor_parallel > 1
        layout = megatron_model.Layout(
            self.tensor_parallel, self.pipeline_parallel, self.context_parallel,
            self.sequence_parallel,
        )  # fmt: skip
        # our norms (megatron_model.SequenceNorm) are built on the CPU, megatron's layers on
        # the GPU when there is one: all of it where the trainer computes
        model = megatron_model.build(self.hf.config, layout, recompute, cfg.ckpt.seed, bf16)
        model = model.to(self.device)
        whole = megatron_model.hf_to_megatron(self.hf.state_dict(), self.hf.config)
        self._load_megatron(model, whole, f"the checkpoint {actor_dir}")
        # a GPU holds the actor once: the skeleton is for config and saving (in the dtype the
        # saved weights have)
        self.hf.to("cpu", self.dtype)
        # Pipelined: every weight's shape, to gather the stages' (megatron/pipeline.py).
        tied = self.hf.config.tie_word_embeddings
        self.megatron_shapes = {
            name: value.shape for name, value in whole.items()
            if not (name == "output_layer.weight" and tied)
        } if self.pipeline_parallel > 1 else {}  # fmt: skip
        self.model = self.train_model = model.train()
        self._start_from_torch_dist(cfg)
        # --use-distributed-optimizer: megatron's gradient buffers and optimizer (on a GPU;
        # megatron/optimizer.py says why not on CPU, where the plain optimizer steps the same)
        self.distributed_optimizer = m.use_distributed_optimizer and self.device.type == "cuda"
        if m.use_distributed_optimizer and not self.distributed_optimizer:
            log.warning(
                "--use-distributed-optimizer: megatron's distributed optimizer needs a GPU; "
                "on this CPU the actor trains with the plain torch optimizer (the same step)"
            )
        # Whole on each tensor parallel rank, each rank with only a share of the gradient
        # (megatron_model.SequenceNorm, HeadNorm): summed over the group before each step.
        self.partial_params = [
            p for p in model.parameters()
            if getattr(p, "sequence_parallel", False) or getattr(p, "partial_over_heads", False)
        ]  # fmt: skip
        if self.distributed_optimizer:
            self.train_model = megatron_optimizer.wrap(model)
            self.sums_own_gradients = True
            self.optimizer = megatron_optimizer.Optimizer(self.train_model, cfg)  # type: ignore[assignment]
            self.scheduler = megatron_optimizer.Schedule(self.optimizer, cfg, total_steps)  # type: ignore[assignment]
        else:  # --bf16: the masters copy the fp32 weights, then the model is cast
            self.make_actor_optimizer()
            megatron_model.cast(model, self.dtype)

    def _start_actor(self) -> None:
        """Nothing yet: the actor is megatron's GPTModel, built (its optimizer too) below."""

    def actor_step(self, max_norm: float) -> dict[str, float]:
        if not self.distributed_optimizer:
            return super().actor_step(max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = self.optimizer.step()  # reduces, clips (to --clip-grad) and steps
        self.scheduler.step()
        return {"grad_norm": grad_norm, "lr": lr}

    def _start_from_torch_dist(self, cfg: RunConfig) -> None:
        """Miles' start: a torch_dist --ref-load is the reference model and, unless a
        torch_dist --load names another, the actor's first weights (a --load of our own
        checkpoint resumes later, build.py). Every rank reads its slices together."""
        ref_dir = megatron_ckpt.torch_dist_dir(cfg.ckpt.ref_load)
        load_dir = megatron_ckpt.torch_dist_dir(cfg.ckpt.load)
        if ref_dir is not None:
            megatron_dist.load(self.model, ref_dir, self.hf.config)
            if self.ref is not None:  # a tied model's lm_head is its embedding
                missing, unexpected = self.ref.load_state_dict(self.gather_weights(), strict=False)
                if unexpected or set(missing) - {"lm_head.weight"}:
                    raise MillstreamError(
                        f"--ref-load {ref_dir} does not fit the reference model: missing "
                        f"{missing[:5]}, unexpected {unexpected[:5]}"
                    )
        if load_dir is not None:
            megatron_dist.load(self.model, load_dir, self.hf.config)
        self.start_checkpoint = load_dir or ref_dir

    def data_parallel_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group() if self.model_parallel > 1 else None

    def _load_megatron(
        self, model: torch.nn.Module, whole: dict[str, torch.Tensor], source: str
    ) -> None:
        """`whole` (hf_to_megatron's: every weight, megatron names) into `model`, this rank
        taking its slices and its stage's layers."""
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank()
        state = megatron_model.shard(whole, model, self.tensor_parallel, rank)
        megatron_model.load_into(model, state, source)

    def _logits(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if model is not self.model and model is not self.train_model:  # reference, teacher: HF
            return super()._logits(model, inputs)
        ids = inputs["input_ids"]
        S = ids.shape[1]
        # Sequence parallel: each rank takes an equal slice of the sequence. Right padding
        # changes no earlier position's logits (causal), and packed, the padding is a sample
        # of its own (its positions restart at 0), which no other attends to.
        # Context parallel: each rank takes 2 of 2 x CP equal chunks, each split again over
        # the tensor parallel ranks under sequence parallelism: padded to a multiple of both.
        multiple = (2 * self.context_parallel if self.context_parallel > 1 else 1) * (
            self.tensor_parallel if self.sequence_parallel else 1
        )
        pad = -S % multiple
        ids = torch.nn.functional.pad(ids, (0, pad))
        device = ids.device
        if "position_ids" in inputs:  # packed: one row of several samples
            positions = inputs["position_ids"]
            tail = torch.arange(pad, device=device)[None].expand(len(ids), -1)
            positions = torch.cat([positions, tail], 1)
            mask = _block_causal_mask(positions)
        else:
            positions, mask = torch.arange(ids.shape[1], device=device)[None].expand_as(ids), None
        length = ids.shape[1]
        if self.context_parallel > 1:  # this rank's share of the sequence
            from . import context as megatron_context

            if mask is None:  # causal by position in the whole sequence
                mask = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
                mask = mask[None, None]
            ids, positions, mask = megatron_context.split(ids, positions, mask)
        if self.pipeline_parallel > 1:
            rows = megatron_model.padded_vocab(self.hf.config, self.tensor_parallel)
            logits = megatron_pipeline.stage_logits(model, ids, positions, mask, rows)
        else:
            logits = model(ids, positions, attention_mask=mask)
        if self.context_parallel > 1:
            logits = megatron_context.gather_sequence(logits, length)
        return megatron_model.unpadded_logits(logits[:, :S], self.hf.config)

    def gather_weights(self) -> dict[str, torch.Tensor]:
        """The whole weights in Hugging Face names; with tensor parallelism a collective of
        the tensor parallel group (each of its ranks calls it, in the same order)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()

        def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
            parts = [torch.empty_like(t) for _ in range(self.tensor_parallel)]
            dist.all_gather(parts, t, group=group)
            return parts

        state = megatron_model.unshard(self.model, self.hf.config, self.tensor_parallel, all_gather)
        if self.pipeline_parallel > 1:  # each stage has its own layers: all of them, everywhere
            state = megatron_pipeline.gather_stages(
                state, self.megatron_shapes, self.hf.config.num_hidden_layers,
                next(self.model.parameters()).dtype,
            )  # fmt: skip
        return megatron_model.megatron_to_hf(state, self.hf.config)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.full_weights is not None:  # tensor parallel: what the last gather collected
            yield from self.full_weights.items()
            return
        for name, value in self.gather_weights().items():
            yield name, value.detach()

    def clip_actor_gradients(self, max_norm: float) -> float:
        """The actor's gradient norm, clipped to `max_norm`, as one rank would see it. First
        the gradients each rank holds only a share of are summed: context parallel ranks'
        (their tokens' shares), tensor parallel ranks' whole norms (their heads' or sequence
        slice's shares), a pipeline's two copies of a tied embedding. Then the squares: a
        tensor parallel parameter's slices summed over its group, a whole one counted once,
        the pipeline stages' summed, the tied copy left out."""
        if self.model_parallel == 1:
            return super().clip_actor_gradients(max_norm)
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.context_parallel > 1:
            self._sum_over_context()
        if self.tensor_parallel > 1:
            self._sum_partial_gradients()
        copy = None
        if self.pipeline_parallel > 1 and self.hf.config.tie_word_embeddings:
            megatron_pipeline.sum_tied_gradients(self.model, self.grad_param)
            if self.model.post_process:
                copy = self.grad_param(self.model.output_layer.weight)
        grads = [(self.grad_param(p).grad, getattr(p, "tensor_model_parallel", False))
                 for p in self.model.parameters()
                 if self.grad_param(p).grad is not None]  # fmt: skip
        split = torch.zeros((), dtype=torch.float64, device=self.device)
        whole = torch.zeros((), dtype=torch.float64, device=self.device)
        for grad, is_split in grads:
            if copy is not None and grad is copy.grad:
                continue
            square = grad.detach().double().pow(2).sum()
            if is_split and self.tensor_parallel > 1:
                split += square
            else:
                whole += square
        if self.tensor_parallel > 1:
            dist.all_reduce(split, group=parallel_state.get_tensor_model_parallel_group())
        total = split + whole
        if self.pipeline_parallel > 1:
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        norm = float(total.sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for grad, _ in grads:
                grad.mul_(coef)
        return norm

    def _sum_over_context(self) -> None:
        """Context parallel: each rank's gradients are its share of the sequence's; their sum
        over the group is the step's (megatron/context.py)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        held = [self.grad_param(p).grad for p in self.model.parameters()]
        grads = [g for g in held if g is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=parallel_state.get_context_parallel_group())
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def _sum_partial_gradients(self) -> None:
        """Qwen3's q/k norms are whole on every tensor parallel rank, but each rank applies
        them to its own heads only, so its gradient is its heads' share; under sequence
        parallelism the residual-stream norms see only the rank's slice of the sequence,
        likewise. The sum over the group is the gradient (megatron leaves this to its
        finalize_model_grads, which this backend's plain torch optimizer does not run).
        Without it the ranks' copies drift apart and differ from one rank's step."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        held = [self.grad_param(p).grad for p in self.partial_params]
        partial = [g for g in held if g is not None]
        if partial:
            flat = torch.cat([g.reshape(-1) for g in partial])
            dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
            offset = 0
            for grad in partial:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def save(
        self, directory: Path, save_optimizer: bool = True, *, actor_optimizer: bool = True
    ) -> None:
        """The checkpoint's Hugging Face files, as the torch backend's (rank 0: saving.py
        writes the HF skeleton with the gathered weights in HF names as its state dict, and
        the optimizer; the distributed optimizer's state is a collective), then the weights as
        megatron's torch_dist files beside them: a collective, which the other ranks join
        through `save_shards`."""
        gathered = self.full_weights
        weights = gathered if gathered is not None else self.gather_weights()
        self.full_weights = {k: v.detach().contiguous().clone() for k, v in weights.items()}
        saved_model, self.model = self.model, self.hf
        try:
            super().save(directory, save_optimizer, actor_optimizer=actor_optimizer)
        finally:
            self.model, self.full_weights = saved_model, gathered
        megatron_dist.save(self.model, directory)

    def save_shards(self, directory: Path, save_optimizer: bool = True) -> None:
        """The other ranks' part of rank 0's `save`, in its order: the distributed
        optimizer's state gathered to rank 0 (which writes it), then the weights in
        megatron's torch_dist format (every rank its slices)."""
        if save_optimizer and self.distributed_optimizer:
            self.optimizer.state_dict()
        megatron_dist.save(self.model, directory)

    def load_weights(self, directory: Path) -> None:
        """A checkpoint's weights: its torch_dist files when it has them (every rank takes
        its slices; any parallel layout saved them), else its Hugging Face model/."""
        if megatron_dist.is_torch_dist(directory):
            megatron_dist.load(self.model, directory, self.hf.config)
        else:
            from safetensors.torch import load_file

            hf_state = load_file(str(directory / "model" / "model.safetensors"))
            whole = megatron_model.hf_to_megatron(hf_state, self.hf.config)
            self._load_megatron(self.model, whole, f"the checkpoint {directory}")
        if self.master is not None:  # until the optimizer's state brings the fp32 ones
            self.master.from_model()


def init_model_parallel(
    tensor_parallel: int, pipeline_parallel: int = 1, context_parallel: int = 1
) -> None:
    """megatron's parallel state over the default process group, with these parallel sizes
    (made again where a process built a backend with other ones before)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel * context_parallel):
        raise MillstreamError(
            f"--tensor-model-parallel-size {tensor_parallel} x --pipeline-model-parallel-size "
            f"{pipeline_parallel} x --context-parallel-size {context_parallel} does not divide "
            f"the {world} trainer ranks: start a multiple of it (torchrun --nproc-per-node)"
        )
    if parallel_state.model_parallel_is_initialized():
        sizes = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_context_parallel_world_size())  # fmt: skip
        if sizes == (tensor_parallel, pipeline_parallel, context_parallel):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_parallel, pipeline_parallel, context_parallel_size=context_parallel
    )
