"""The torch backend: a Hugging Face causal LM trained with a torch optimizer.

Logprobs are computed as the engine reports them (SGLang's default): log_softmax of the
logits divided by the rollout temperature (1 for greedy). Response token k of a sample whose
prompt has p tokens is tokens[p + k], predicted by the logits at position p + k - 1.

One rollout = `num_steps` optimizer steps over consecutive slices of `global_batch_size`
samples, each accumulated over micro-batches of `--micro-batch-size`. With one step per
rollout, the old policy IS the current one (no update happens between computing it and the
step), so old_logp = logp.detach() and the ratio is exactly 1; with more steps, the old
logprobs are recomputed before the first step and kept fixed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.nn.utils import clip_grad_norm_

from millstream.common.config import RunConfig
from millstream.common.errors import MillstreamError

from ..algorithms.loss import Denominator, policy_loss
from .base import TrainSample

OPTIMIZER_FILE = "optimizer.pt"


def load_causal_lm(path: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not Path(path, "config.json").is_file():
        raise MillstreamError(
            f"{path} is not a Hugging Face model dir (no config.json): check --hf-checkpoint / --load"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


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


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous share of n items; shares differ in size by at most one."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class TorchBackend:
    def __init__(
        self, cfg: RunConfig, actor_dir: str | Path, *, ref_dir: str | Path | None, total_steps: int
    ):
        torch.manual_seed(cfg.ckpt.seed)
        self.cfg = cfg
        self.temperature = (
            cfg.rollout.rollout_temperature if cfg.rollout.rollout_temperature > 1e-6 else 1.0
        )
        self.model = load_causal_lm(actor_dir)
        self.model.train()
        self.ref = load_causal_lm(ref_dir).eval().requires_grad_(False) if ref_dir else None
        o = cfg.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        if o.optimizer == "adam":
            self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(
                params,
                lr=o.lr,
                betas=(o.adam_beta1, o.adam_beta2),
                eps=o.adam_eps,
                weight_decay=o.weight_decay,
            )
        else:
            self.optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, cfg, total_steps)
        )
        # Set by DataParallel: this rank's place, and the sum across ranks of the gradients
        # and of the per-shard metric sums it is given.
        self.rank, self.world_size = 0, 1
        self.reduce_across_ranks: Callable[[dict[str, float]], dict[str, float]] | None = None

    # -- forward -------------------------------------------------------------------------------

    def _logprobs(
        self, model: torch.nn.Module, samples: list[TrainSample], with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(logp_BT, entropy_BT or None, valid_BT) over the response positions of each sample."""
        B, S = len(samples), max(len(s.tokens) for s in samples)
        T = max(1, max(s.response_len for s in samples))
        ids_BS = torch.zeros(B, S, dtype=torch.long)
        attn_BS = torch.zeros(B, S, dtype=torch.long)
        pos_BT = torch.zeros(B, T, dtype=torch.long)
        valid_BT = torch.zeros(B, T)
        for i, s in enumerate(samples):
            ids_BS[i, : len(s.tokens)] = torch.tensor(s.tokens)
            attn_BS[i, : len(s.tokens)] = 1
            pos_BT[i, : s.response_len] = torch.arange(s.prompt_len - 1, len(s.tokens) - 1)
            valid_BT[i, : s.response_len] = 1
        logits_BSV = model(input_ids=ids_BS, attention_mask=attn_BS).logits
        V = logits_BSV.shape[-1]
        logits_BTV = (
            logits_BSV.gather(1, pos_BT[..., None].expand(B, T, V)).float() / self.temperature
        )
        logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
        targets_BT = ids_BS.gather(1, (pos_BT + 1).clamp(max=S - 1))
        logp_BT = logp_BTV.gather(-1, targets_BT[..., None]).squeeze(-1) * valid_BT
        entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1) * valid_BT if with_entropy else None
        return logp_BT, entropy_BT, valid_BT

    @torch.no_grad()
    def logprobs(self, samples: list[TrainSample], use_ref: bool = False) -> list[torch.Tensor]:
        """Per-sample response logprobs under the actor (or the reference), no grad."""
        model = self.ref if use_ref else self.model
        if model is None:
            raise MillstreamError(
                "no reference model loaded (--use-kl-loss with --ref-load or --hf-checkpoint)"
            )
        out: list[torch.Tensor] = []
        for mb in self._micro_batches(samples):
            logp_BT, _, _ = self._logprobs(model, mb, with_entropy=False)
            out += [logp_BT[i, : s.response_len].clone() for i, s in enumerate(mb)]
        return out

    # -- training ------------------------------------------------------------------------------

    def _micro_batches(self, samples: list[TrainSample]) -> Iterator[list[TrainSample]]:
        size = self.cfg.perf.micro_batch_size
        for start in range(0, len(samples), size):
            yield samples[start : start + size]

    @staticmethod
    def _pad(rows: list[list[float]] | list[torch.Tensor], T: int) -> torch.Tensor:
        out = torch.zeros(len(rows), T)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
        return out

    def train_rollout(self, samples: list[TrainSample], num_steps: int) -> dict[str, float]:
        """`num_steps` optimizer steps over consecutive equal slices of the samples."""
        if len(samples) % num_steps:
            raise ValueError(f"{len(samples)} samples do not split into {num_steps} equal steps")
        per_step = len(samples) // num_steps
        if per_step < self.world_size:
            raise ValueError(
                f"{per_step} samples per step cannot be shared by {self.world_size} trainer ranks"
            )
        lo, hi = shard_bounds(per_step, self.rank, self.world_size)
        mine = [s for k in range(num_steps) for s in samples[k * per_step + lo : k * per_step + hi]]
        old = self.logprobs(mine) if num_steps > 1 else None
        ref = self.logprobs(mine, use_ref=True) if self.ref is not None else None
        n = hi - lo
        totals: dict[str, float] = defaultdict(float)
        for k in range(num_steps):
            step_metrics = self._step(
                samples[k * per_step : (k + 1) * per_step],
                None if old is None else old[k * n : (k + 1) * n],
                None if ref is None else ref[k * n : (k + 1) * n],
            )
            for name, value in step_metrics.items():
                totals[name] += value / num_steps
        return dict(totals)

    def _step(
        self,
        samples: list[TrainSample],
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
    ) -> dict[str, float]:
        """One optimizer step over the slice `samples`; `old`/`ref` cover this rank's shard."""
        self.optimizer.zero_grad(set_to_none=True)
        denom = Denominator(
            n_samples=len(samples), n_tokens=max(1, sum(sum(s.loss_mask) for s in samples))
        )
        lo, hi = shard_bounds(len(samples), self.rank, self.world_size)
        metrics = self.accumulate_gradients(samples[lo:hi], old, ref, denom)
        if self.reduce_across_ranks is not None:
            metrics = self.reduce_across_ranks(metrics)
        clip = self.cfg.optimizer.clip_grad
        metrics["grad_norm"] = float(
            clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        )
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return metrics

    def accumulate_gradients(
        self,
        samples: list[TrainSample],
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
        denom: Denominator | None = None,
    ) -> dict[str, float]:
        """Backward over micro-batches; the summed gradient is the gradient of the loss over
        the slice `denom` counts (by default, `samples` itself)."""
        denom = denom or Denominator(
            n_samples=len(samples), n_tokens=max(1, sum(sum(s.loss_mask) for s in samples))
        )
        metrics: dict[str, float] = defaultdict(float)
        offset = 0
        for mb in self._micro_batches(samples):
            logp_BT, entropy_BT, valid_BT = self._logprobs(self.model, mb, with_entropy=True)
            T = logp_BT.shape[1]
            rows = slice(offset, offset + len(mb))
            offset += len(mb)
            mask_BT = self._pad([s.loss_mask for s in mb], T) * valid_BT
            adv_BT = torch.tensor([s.advantage for s in mb])[:, None].expand(-1, T)
            old_BT = logp_BT.detach() if old is None else self._pad(old[rows], T)
            loss, mb_metrics = policy_loss(
                logp_BT, old_BT, adv_BT, mask_BT, self.cfg.algo, denom,
                rollout_logp_BT=self._pad([s.rollout_logprobs for s in mb], T),
                ref_logp_BT=None if ref is None else self._pad(ref[rows], T),
                entropy_BT=entropy_BT,
            )  # fmt: skip
            loss.backward()
            metrics["loss"] += loss.item()
            for name, value in mb_metrics.items():
                metrics[name] += value
        return dict(metrics)

    # -- weights and checkpoints ---------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def save(self, directory: Path, save_optimizer: bool = True) -> None:
        self.model.save_pretrained(directory / "model", safe_serialization=True)
        if save_optimizer:
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                },
                directory / OPTIMIZER_FILE,
            )

    def load(self, directory: Path, load_optimizer: bool = True) -> None:
        from safetensors.torch import load_model

        load_model(self.model, str(directory / "model" / "model.safetensors"), strict=False)
        opt_path = directory / OPTIMIZER_FILE
        if load_optimizer and opt_path.is_file():
            state = torch.load(opt_path, weights_only=True)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
