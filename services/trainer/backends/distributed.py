"""Data parallel (and sharded) training under torchrun: rank 0 is the trainer, ranks > 0 only
train.

Rank 0 alone talks to the services (admits, reads the buffer, syncs weights, logs, saves).
Per rollout it broadcasts a command and the samples to every rank; each rank trains on its
contiguous shard of every step slice with the Denominator of the whole slice, so the SUM of
the ranks' gradients is the one-rank gradient of that slice. The gradients cross as torch's
DistributedDataParallel moves them (model and critic wrapped, buckets all-reduced while the
backward still runs), with a communication hook that sums instead of averaging; the earlier
micro-batches of a step accumulate under `no_sync()`, so every rank syncs exactly once per
step whatever its micro-batch count (loop.py `_last_synced`). Buffers are not synced in
forwards (nothing in a forward is a collective, so the no-grad forwards need no lockstep).
Every rank then clips and steps alike; starting from the same weights (same checkpoint, same
seed) with the same optimizer state, the weights stay identical on all ranks. Metrics that
are per-shard sums are all-reduced too; grad_norm and lr are then equal on every rank.

--train-backend fsdp shards the actor instead (`_fully_shard`: torch's FSDP2, one unit per
decoder layer and the root; gradients summed in the reduce-scatter; the critic stays DDP).
Every forward of the actor is then a collective: the backend runs each rank's forwards in
lockstep (`lockstep`, the max micro-batch count across ranks; idle 1-token rounds make up
the difference). After every rollout all ranks gather the full weights, which rank 0 keeps
for the weight sync and for checkpoints (`_gather_weights`). A save is a command too (SAVE,
with the directory): rank 0 writes the Hugging Face weights and the critic, every rank its
optimizer shard (`optimizer.rank{r}.pt`, DTensor state as local tensors), then a barrier. On
resume the weights load before sharding (build.py) and each rank its own shard after.

--train-backend megatron with --tensor-model-parallel-size N splits the actor's layers over N
consecutive ranks (megatron's parallel state; backends/megatron/backend.py): the samples are
split among the data parallel ranks only (`backend.data_parallel_group()`: DDP, the metric
sums and the per-rank shares are over it; a tensor parallel group trains the same samples
together), every rank gathers the whole weights after each rollout (rank 0 keeps them) and
saves its optimizer slice like an FSDP shard.

--bf16 (backends/precision.py): the data parallel actor is not wrapped in DDP, whose buckets
would sum its bf16 gradients; the hooks move each into its fp32 master during the backward, and
after it the masters' gradients are summed over the ranks in fp32 (`sum_master_gradients`), so
every rank steps identical masters. FSDP shards the fp32 weights instead, with its own mixed
precision (bf16 to compute, the gradients reduce-scattered in fp32): the shards are the
masters, saved beside each rank's optimizer shard, and the weights gathered after a rollout are
cast to bf16, what the engines get from one rank. The megatron backend's actor keeps
MasterWeights, whose gradients are summed over its data parallel group the same way, and whose
slices each rank saves with its optimizer slice.

Samples cross as tensors, never pickles: a header [command, num_steps, n_samples, the lengths
of the flat payloads, rollout_id], then per-sample ints (len(tokens), prompt_len,
len(loss_mask), len(rollout_logprobs), len(teacher_logprobs), behavior_version, version_lag),
the flat tokens and loss masks (int64), and the flat rollout and teacher logprobs and the
rewards (float64, as the samples hold them).

Blocking calls: run `DataParallel.train_rollout` from a worker thread, never the event loop.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from datetime import timedelta
from itertools import accumulate, pairwise
from pathlib import Path

import torch
import torch.distributed as dist

from millstream.common.errors import MillstreamError

from .base import TrainSample
from .loop import StepLoop
from .saving import SHARD_FILE, load_state, sharded_optimizer_files

TRAIN, STOP, SAVE = 1, 0, 2
HEADER = 8
INTS = 7  # per-sample ints
# Followers wait in a broadcast while rank 0 collects a rollout, which may take long; a dead
# rank 0 is torchrun's to detect (it ends the other ranks), so this only bounds true hangs.
TIMEOUT = timedelta(hours=24)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init() -> int:
    """Join the default process group from torchrun's env (gloo on CPU, nccl with CUDA);
    return this rank."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=TIMEOUT)
    return dist.get_rank()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def encode(samples: list[TrainSample]) -> list[torch.Tensor]:
    """[ints_N7, tokens, loss masks, rollout logprobs, teacher logprobs, rewards_N]."""
    ints = torch.tensor(
        [
            [len(s.tokens), s.prompt_len, len(s.loss_mask), len(s.rollout_logprobs),
             len(s.teacher_logprobs), s.behavior_version, s.version_lag]
            for s in samples
        ],
        dtype=torch.int64,
    ).reshape(-1, INTS)  # fmt: skip
    return [
        ints,
        torch.tensor([t for s in samples for t in s.tokens], dtype=torch.int64),
        torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.int64),
        torch.tensor([x for s in samples for x in s.rollout_logprobs], dtype=torch.float64),
        torch.tensor([x for s in samples for x in s.teacher_logprobs], dtype=torch.float64),
        torch.tensor([s.reward for s in samples], dtype=torch.float64),
    ]


def decode(payload: list[torch.Tensor]) -> list[TrainSample]:
    ints, tokens, masks, logps, teacher, rewards = (t.cpu().tolist() for t in payload)

    def split(flat: list, lengths: list[int]) -> Iterator[list]:
        starts = [0, *accumulate(lengths)]
        return (flat[a:b] for a, b in pairwise(starts))

    cols = list(zip(*ints, strict=True)) if ints else [()] * INTS
    return [
        TrainSample(
            tokens=tok, prompt_len=p, loss_mask=m, rollout_logprobs=lp, reward=r,
            behavior_version=bv, version_lag=v, teacher_logprobs=tl,
        )
        for tok, p, m, lp, tl, bv, v, r in zip(
            split(tokens, cols[0]), cols[1], split(masks, cols[2]), split(logps, cols[3]),
            split(teacher, cols[4]), cols[5], cols[6], rewards, strict=True,
        )
    ]  # fmt: skip


def _broadcast_header(header: list[int]) -> list[int]:
    t = torch.tensor(header, dtype=torch.int64, device=_device())
    dist.broadcast(t, src=0)
    return t.tolist()


def _sum_hook(group, bucket):  # type: ignore[no-untyped-def]
    """DDP's all-reduce of a gradient bucket, summed (DDP's default divides by the world).
    Takes (group: ProcessGroup | None, bucket: GradBucket), returns a Future[Tensor]; left
    unannotated because DDP checks annotations against its classes, and ours are strings."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


def _no_buffer_sync(ddp_class: type) -> dict[str, bool]:
    """DDP's switch that leaves buffers out of the forward's broadcast (the model has none that
    change): `forward_sync_buffers` from torch 2.13, which deprecates the older
    `broadcast_buffers`; torch 2.11, the GPU image's, knows only the older name."""
    params = inspect.signature(ddp_class.__init__).parameters
    name = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return {name: False}


def _summing_ddp(module: torch.nn.Module, group: dist.ProcessGroup | None) -> torch.nn.Module:
    """`module` under DistributedDataParallel whose backward sums gradients across the ranks
    of `group` (None: all)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if dist.get_backend() == "nccl" else None
    ddp = DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=group,
        **_no_buffer_sync(DistributedDataParallel),
    )
    ddp.register_comm_hook(group, _sum_hook)
    return ddp


def _fully_shard(backend: StepLoop) -> None:
    """--train-backend fsdp: the actor sharded with torch's fully_shard (FSDP2), one unit per
    decoder layer and the root (embeddings, final norm, head), gradients summed in the
    reduce-scatter (each rank's loss is over the whole slice already); the optimizer made
    again over the sharded parameters. --bf16: FSDP's mixed precision, over the fp32 weights
    (the masters the backend made, which it drops): each unit gathers its shards as bf16 to
    compute, and reduce-scatters the bf16 gradients in fp32 into the fp32 shards' gradients
    (several micro-batches summed there, in fp32)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = backend.model
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise MillstreamError(
            f"--train-backend fsdp shards a Hugging Face causal LM by its decoder layers "
            f"(model.model.layers); {type(model).__name__} has none"
        )
    policy = MixedPrecisionPolicy()
    if backend.master is not None:
        masters = backend.master
        masters.remove()
        model.to(torch.float32)
        masters.to_model()  # the fp32 weights themselves, not their bf16 rounding
        backend.master, backend.keeps_masters = None, False
        policy = MixedPrecisionPolicy(param_dtype=backend.dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    backend.make_actor_optimizer()


def _local_state(state: dict) -> dict:
    """An optimizer state_dict with each DTensor (a sharded parameter's state) as this rank's
    local shard: plain tensors, which load with weights_only."""
    from torch.distributed.tensor import DTensor

    return {
        "state": {
            k: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in per.items()}
            for k, per in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def _load_local_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """`_local_state`'s inverse: load it, then make each shard a DTensor again, placed like its
    parameter."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            per = optimizer.state[param]
            for name, value in per.items():
                if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape:
                    per[name] = DTensor.from_local(
                        value, param.device_mesh, param.placements, run_check=False,
                        shape=param.shape, stride=param.stride(),
                    )  # fmt: skip


def send_stop(timeout: timedelta = timedelta(seconds=60)) -> None:
    """Rank 0: tell the followers to return from `follow`. Bounded: after an error in the
    middle of a rollout the followers wait in another collective and never take it; rank 0
    then exits with its error and torchrun ends them."""
    t = torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64, device=_device())
    work = dist.broadcast(t, src=0, async_op=True)
    assert work is not None
    work.wait(timeout=timeout)


class DataParallel:
    """A backend (loop.py `StepLoop`) on one rank of the default process group, with the
    backend's interface for rank 0 (`train_rollout`, `named_weights`, `save`, `load`) and
    `follow` for the others."""

    def __init__(self, backend: StepLoop):
        self.backend = backend
        self.device = _device()
        self.rank = dist.get_rank()
        # The ranks that split the samples: all of them, or (megatron's tensor parallelism)
        # one of each tensor parallel group, whose ranks share theirs.
        self.group = backend.data_parallel_group()
        backend.rank = dist.get_rank(self.group)
        backend.world_size = dist.get_world_size(self.group)
        self.sharded = backend.cfg.ckpt.train_backend == "fsdp"
        self.model_parallel = backend.model_parallel > 1  # megatron's tensor and pipeline
        # Each rank has optimizer state of its own to save: FSDP's shards, megatron's slices.
        self.sharded_optimizer = self.sharded or self.model_parallel
        if self.sharded:
            _fully_shard(backend)
            backend.lockstep = self._max_across_ranks
        elif backend.world_size > 1 and not backend.sums_own_gradients:
            master = backend.master
            if master is not None:  # --bf16: the masters' fp32 gradients, not DDP's bf16 ones
                backend.sum_master_gradients = lambda: master.sum_grads(self.group)
            else:
                backend.train_model = _summing_ddp(backend.model, self.group)
        self._gather_weights()
        if backend.critic is not None:  # the critic is never sharded
            backend.train_critic = _summing_ddp(backend.critic, self.group)
        backend.reduce_across_ranks = self._sum_across_ranks
        backend.sum_across_ranks = self._sum_tensor

    def train_rollout(
        self, samples: list[TrainSample], num_steps: int, rollout_id: int = 0
    ) -> dict[str, float]:
        payload = encode(samples)
        sizes = [t.numel() for t in payload[1:5]]
        _broadcast_header([TRAIN, num_steps, len(samples), *sizes, rollout_id])
        for t in payload:
            dist.broadcast(t.to(self.device), src=0)
        metrics = self.backend.train_rollout(samples, num_steps, rollout_id)
        self._gather_weights()
        return metrics

    def follow(self) -> None:
        """Ranks > 0: train (or save) as rank 0 broadcasts, until it says STOP."""
        while True:
            header = _broadcast_header([0] * HEADER)
            command, num_steps, n, n_tokens, n_masks, n_logps, n_teacher, rollout_id = header
            if command == STOP:
                return
            if command == SAVE:
                path = torch.empty(n, dtype=torch.uint8, device=self.device)
                dist.broadcast(path, src=0)
                directory = Path(bytes(path.tolist()).decode())
                if self.backend.collective_save:
                    self.backend.save_shards(directory, save_optimizer=bool(num_steps))
                self._save_shard(directory, bool(num_steps))
                continue
            shapes = [((n, INTS), torch.int64), ((n_tokens,), torch.int64), ((n_masks,), torch.int64),
                      ((n_logps,), torch.float64), ((n_teacher,), torch.float64),
                      ((n,), torch.float64)]  # fmt: skip
            payload = [
                torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes
            ]
            for t in payload:
                dist.broadcast(t, src=0)
            self.backend.train_rollout(decode(payload), num_steps, rollout_id)
            self._gather_weights()

    def _max_across_ranks(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _gather_weights(self) -> None:
        """Sharded: every rank gathers each parameter (all ranks, in the same order); tensor
        parallel: the ranks of rank 0's group (data parallel rank 0; the other groups' copies
        would be thrown away). Rank 0 keeps the full copy that weight syncs and checkpoints
        read (backend.full_weights)."""
        if self.model_parallel:
            in_rank0_group = self.backend.rank == 0
            full = self.backend.gather_weights() if in_rank0_group else {}  # type: ignore[attr-defined]
            self.backend.full_weights = full if self.rank == 0 else {}
            return
        if not self.sharded:
            return
        from torch.distributed.tensor import DTensor

        full = {}
        for name, param in self.backend.model.named_parameters():
            value = param.full_tensor() if isinstance(param, DTensor) else param
            if self.rank == 0:  # --bf16: the fp32 shards' rounding, as one rank's weights
                full[name] = value.detach().to(self.backend.dtype)
        self.backend.full_weights = full if self.rank == 0 else {}

    def _sum_across_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        """The per-shard metric sums of a step, summed (the gradients are DDP's)."""
        names = sorted(metrics)
        values = torch.tensor([metrics[k] for k in names], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=self.group)
        return dict(zip(names, values.tolist(), strict=True))

    def _sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone().to(self.device)
        dist.all_reduce(out, group=self.group)
        return out.to(t.device)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.backend.named_weights()

    def save(self, directory: Path, save_optimizer: bool = True) -> None:
        """Rank 0. Sharded (or tensor parallel): every rank writes its optimizer shard (told by
        a SAVE command), rank 0 the gathered weights in Hugging Face format and the critic;
        the same files as one rank's otherwise. The megatron backend's torch_dist files are
        written by every rank together (a SAVE command too, its `save_shards`)."""
        if not (self.sharded_optimizer or self.backend.collective_save):
            self.backend.save(directory, save_optimizer)
            return
        path = torch.tensor(list(str(directory).encode()), dtype=torch.uint8, device=self.device)
        _broadcast_header([SAVE, int(save_optimizer), path.numel(), 0, 0, 0, 0, 0])
        dist.broadcast(path, src=0)
        self.backend.save(
            directory, save_optimizer, actor_optimizer=not self.sharded_optimizer
        )  # the megatron backend: with its torch_dist files, which the others join
        self._save_shard(directory, save_optimizer)

    def _save_shard(self, directory: Path, save_optimizer: bool) -> None:
        if save_optimizer and self.sharded_optimizer:
            torch.save(
                {
                    "optimizer": _local_state(self.backend.optimizer.state_dict()),
                    "scheduler": self.backend.scheduler.state_dict(),
                    "world_size": dist.get_world_size(),
                    **self._masters(),
                },
                directory / SHARD_FILE.format(rank=self.rank),
            )
        dist.barrier()  # every shard is written before rank 0 makes the checkpoint the latest

    def _masters(self) -> dict[str, list[torch.Tensor]]:
        """--bf16: this rank's fp32 masters, which the bf16 model/ only rounds: FSDP's shards
        of the fp32 weights, or megatron's MasterWeights (its slices and stage); else none."""
        if self.backend.master is not None:
            return self.backend.master.state_dict()
        if self.sharded and self.backend.cfg.perf.bf16:
            return {"master": [p.to_local().detach().clone() for p in self._sharded_params()]}
        return {}

    def _load_masters(self, state: dict) -> None:
        if "master" not in state:
            return
        if self.backend.master is not None:
            self.backend.master.load_state_dict(state)
            return
        params = self._sharded_params()
        if len(params) != len(state["master"]):
            raise MillstreamError(
                f"the optimizer shard holds {len(state['master'])} fp32 weight shards for "
                f"{len(params)} parameters: not this model's"
            )
        with torch.no_grad():
            for param, saved in zip(params, state["master"], strict=True):
                param.to_local().copy_(saved)

    def _sharded_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.backend.model.parameters() if p.requires_grad]

    def load(self, directory: Path, load_optimizer: bool = True) -> None:
        """Sharded: the actor's weights were loaded before sharding (`build`); here the critic
        and this rank's optimizer shard (tensor parallel: the weights too, each rank taking
        its slices). Each rank calls it for itself."""
        if not self.sharded_optimizer:
            self.backend.load(directory, load_optimizer)
            return
        if not self.sharded:
            self.backend.load_weights(directory)
            self._gather_weights()
        self.backend.load(directory, load_optimizer, actor=False)
        if not load_optimizer:
            return
        world = dist.get_world_size()
        shards = sharded_optimizer_files(directory)
        if len(shards) != world:
            raise MillstreamError(
                f"{directory} holds {len(shards)} optimizer shard(s) (optimizer.rank*.pt) for "
                f"{world} ranks: resume with as many ranks as saved it, or --no-load-optim"
            )
        state = load_state(directory / SHARD_FILE.format(rank=self.rank))
        _load_local_state(self.backend.optimizer, state["optimizer"])
        self.backend.scheduler.load_state_dict(state["scheduler"])
        self._load_masters(state)  # (their bf16 rounding is what model/ held: gathered already)
