"""The user's TIS/RS function (--custom-tis-function-path with --use-tis), called in the loss
as Miles calls it (miles/backends/training_utils/loss_hub/losses.py `policy_loss_function`):

    pg_loss, loss_masks, metrics = fn(
        args=args,                    # Miles' args (compat/miles make_args)
        pg_loss=pg_loss,              # [sum of response lengths]: the clipped PPO term per token,
                                      #   the samples' response tokens one after another
        train_log_probs=[...],        # per sample [response length]: the trainer's old logprobs
        rollout_log_probs=[...],      # per sample: the engines' logprobs of the same tokens
        loss_masks=[...],             # per sample: 1 where the token trains
        total_lengths=[...],          # per sample: prompt + response tokens
        response_lengths=[...],
        parallel_state=...,           # ranks, see `ParallelState`
        max_seq_lens=None,
    )

It returns the weighted pg_loss (same layout), one mask per sample (rejection sampling zeroes
tokens or whole samples), and metrics: name -> per-token values (a flat tensor in pg_loss's
layout, or one tensor per sample). What the loss does with them, as Miles does
(trainer/algorithms/loss.py): the new masks pick the tokens of the numerator of every term
(policy, entropy, KL), the denominators stay those of the original masks; each metric is
reduced like the loss over the original masks and logged as train/<name>.

The function sees whole sequences: the trainer gathers the logprobs of a context parallel
group before the loss, so `parallel_state.cp.size` is 1. Miles' two built-ins
(vanilla_tis_function, icepop_function) are --tis-mode tis and icepop, never loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from millstream.common.errors import MillstreamError
from millstream.compat.plugins import load_function

FLAG = "--custom-tis-function-path"


@dataclass(frozen=True)
class GroupInfo:
    """A process group as Miles' GroupInfo names it: this rank's place and the group's size."""

    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class ParallelState:
    """Miles' parallel_state, as far as a TIS function reads it: data parallel ranks (each
    holds a share of the batch), and no context, tensor, pipeline or expert split of the
    tensors it is handed."""

    intra_dp: GroupInfo = field(default_factory=GroupInfo)
    cp: GroupInfo = field(default_factory=GroupInfo)
    tp: GroupInfo = field(default_factory=GroupInfo)
    pp: GroupInfo = field(default_factory=GroupInfo)
    ep: GroupInfo = field(default_factory=GroupInfo)

    @property
    def dp(self) -> GroupInfo:
        return self.intra_dp

    @property
    def effective_dp(self) -> GroupInfo:
        return self.intra_dp


@dataclass(frozen=True)
class TisOutput:
    """What the function gave, padded back to the loss's [B, T] layout."""

    pg_BT: torch.Tensor
    keep_BT: torch.Tensor  # the returned masks: the tokens the numerators count
    metrics_BT: dict[str, torch.Tensor]


class CustomTis:
    """The user's function with the `args` and ranks it is called with (one per trainer)."""

    def __init__(
        self,
        path: str,
        args: Any,
        parallel_state: ParallelState | None = None,
        fn: Callable[..., Any] | None = None,
    ):
        self.path = path
        self.fn = fn or load_function(path, FLAG)
        self.args = args
        self.parallel_state = parallel_state or ParallelState()

    def __call__(
        self,
        pg_BT: torch.Tensor,
        train_logp_BT: torch.Tensor,
        rollout_logp_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        response_lengths: Sequence[int],
        total_lengths: Sequence[int],
    ) -> TisOutput:
        lengths = [int(n) for n in response_lengths]

        def rows(x_BT: torch.Tensor) -> list[torch.Tensor]:
            return [x_BT[i, :n] for i, n in enumerate(lengths)]

        try:
            out = self.fn(
                args=self.args,
                pg_loss=torch.cat(rows(pg_BT)),
                train_log_probs=[x.detach() for x in rows(train_logp_BT)],
                rollout_log_probs=[x.detach() for x in rows(rollout_logp_BT)],
                loss_masks=rows(mask_BT),
                total_lengths=list(total_lengths),
                response_lengths=lengths,
                parallel_state=self.parallel_state,
                max_seq_lens=None,
            )
        except Exception as err:
            raise MillstreamError(f"{FLAG} {self.path} raised {type(err).__name__}: {err}") from err
        if not (isinstance(out, tuple | list) and len(out) == 3):
            raise MillstreamError(
                f"{FLAG} {self.path} returned {type(out).__name__}; it must return "
                "(pg_loss, loss_masks, metrics) as Miles' TIS functions do"
            )
        pg, masks, metrics = out
        T = pg_BT.shape[1]
        if not isinstance(metrics, dict):
            raise MillstreamError(f"{FLAG} {self.path}: its metrics are not a dict of tensors")
        return TisOutput(
            pg_BT=self._padded(pg, lengths, T, pg_BT, "pg_loss"),
            keep_BT=self._padded(masks, lengths, T, mask_BT, "loss_masks").detach(),
            metrics_BT={
                str(name): self._padded(value, lengths, T, pg_BT, f"metric {name!r}").detach()
                for name, value in metrics.items()
            },
        )

    def _padded(
        self, value: Any, lengths: list[int], T: int, like_BT: torch.Tensor, what: str
    ) -> torch.Tensor:
        """`value` (flat over the response tokens, or one tensor per sample) as [B, T]."""
        total = sum(lengths)
        if isinstance(value, list | tuple):
            parts = [torch.as_tensor(v).reshape(-1) for v in value]
            if [p.numel() for p in parts] != lengths:
                raise MillstreamError(
                    f"{FLAG} {self.path}: {what} has lengths {[p.numel() for p in parts]}, "
                    f"the samples' responses {lengths}"
                )
        else:
            flat = torch.as_tensor(value).reshape(-1)
            if flat.numel() == 1 and total != 1:  # a scalar: the same for every token
                flat = flat.expand(total)
            if flat.numel() != total:
                raise MillstreamError(
                    f"{FLAG} {self.path}: {what} has {flat.numel()} values for the "
                    f"{total} response tokens of the micro-batch"
                )
            parts = list(flat.split(lengths))
        out = [
            torch.nn.functional.pad(p.to(like_BT.device, like_BT.dtype), (0, T - p.numel()))
            for p in parts
        ]
        return torch.stack(out)
