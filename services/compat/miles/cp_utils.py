"""Miles' `miles.backends.training_utils.cp_utils`, as far as a loss or TIS function uses it,
for millstream's context parallel layout.

In Miles each context parallel (CP) rank holds two of the 2 x CP chunks of every sequence and
runs the loss on its share, so a CP-aware TIS function (mis.py's
`compute_mis_weights_with_cp`, the one Miles' run-qwen3-4b-mis.sh passes with
--context-parallel-size 2) gathers each sample's response values from the group
(`all_gather_with_cp`), weighs whole responses, and cuts its own share back out
(`slice_log_prob_with_cp`) to multiply its pg_loss.

millstream's loss never sees a share. The megatron backend's CP ranks gather their logits back
into sequence order before the loss (trainer/backends/megatron/context.py `gather_sequence`),
each rank of the group computing the same loss on whole sequences; the torch and fsdp backends
have one CP rank. So whatever --context-parallel-size is, the group a loss or TIS function
sees has one rank (the `parallel_state.cp.size` it is handed is 1, trainer/algorithms/tis.py),
and these functions are Miles' at CP size 1, with Miles' signatures:

* `all_gather_with_cp` and `slice_log_prob_with_cp` return what they are given, the same
  object, so autograd and list-vs-tensor are untouched;
* `get_local_response_loss_masks` / `slice_loss_masks_for_local_cp` return the masks;
* `get_sum_of_sample_mean` is Miles' reducer: each sample's masked sum over its own
  denominator (its mask's sum unless `denominators` says otherwise), summed; per token, the
  masked sums alone.

`qkv_format` and the padded lengths only place chunks when CP > 1: accepted and unused (None
included: `args.qkv_format` is Miles' default "thd" here, compat/miles Args). A tensor to
gather or slice that is not a whole response would be a CP share, which millstream never
hands out: ValueError naming the function and the CP size, not a wrong answer.

Miles' other cp_utils functions place chunks in a model's inputs or attention (`slice_with_cp`,
`natural_to_zigzag_slice`, `build_gdn_cp_context`, ...). millstream's backends do that
themselves, so importing one raises ImportError naming it and why (`__getattr__`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

__all__ = [
    "all_gather_with_cp",
    "get_local_response_loss_masks",
    "get_sum_of_sample_mean",
    "slice_log_prob_with_cp",
    "slice_loss_masks_for_local_cp",
]

Values = TypeVar("Values", list, torch.Tensor)

# Miles' cp_utils names (at the commit examples/miles_compat follows and since) that lay out a
# model's inputs or attention for CP > 1; not stood in for.
_MODEL_SIDE = frozenset(
    {
        "get_logits_and_tokens_offset_with_cp",
        "slice_with_cp",
        "natural_to_zigzag_slice",
        "allgather_cp_redistribute",
        "assemble_log_prob_from_cp",
        "build_gdn_cp_context",
    }
)


def __getattr__(name: str) -> Any:
    # ImportError, not AttributeError: `from ... import name` then shows this message instead
    # of a bare "cannot import name".
    if name in _MODEL_SIDE:
        raise ImportError(
            f"{name} (miles.backends.training_utils.cp_utils) places a sequence's context "
            "parallel chunks in a model's inputs or attention, which millstream's backends do "
            "themselves (--context-parallel-size with --train-backend megatron); a loss or TIS "
            "function sees whole sequences here, one CP rank: use all_gather_with_cp and "
            "slice_log_prob_with_cp, which are the identity",
            name=__name__,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _whole(function: str, values: Values, response_length: int) -> Values:
    if len(values) != response_length:
        raise ValueError(
            f"{function}: got {len(values)} values for a response of {response_length} tokens. "
            "millstream's loss hands a TIS or loss function whole responses (its context "
            "parallel ranks gather the sequence first, so the group it sees has CP size 1); "
            "a shorter one would be one rank's share, which millstream never makes"
        )
    return values


def all_gather_with_cp(
    tensor: torch.Tensor,
    total_length: int,
    response_length: int,
    qkv_format: str = "thd",
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One sample's response values from every CP rank, `response_length` first: at CP size
    1, `tensor` itself."""
    return _whole("all_gather_with_cp", tensor, response_length)


def slice_log_prob_with_cp(
    log_prob: list[float] | torch.Tensor,
    total_length: int,
    response_length: int,
    qkv_format: str = "thd",
    max_token_len: int | None = None,
) -> list[float] | torch.Tensor:
    """This CP rank's share of one sample's whole response values: at CP size 1, all of
    them, `log_prob` itself (a list stays a list)."""
    return _whole("slice_log_prob_with_cp", log_prob, response_length)


def get_local_response_loss_masks(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    qkv_format: str = "thd",
    max_seq_lens: list[int] | None = None,
) -> list[torch.Tensor]:
    """The response loss masks aligned with this rank's logprobs: at CP size 1, the masks."""
    return loss_masks


def slice_loss_masks_for_local_cp(
    loss_masks: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    qkv_format: str = "thd",
    max_seq_lens: list[int] | None = None,
) -> list[torch.Tensor]:
    """Miles' older name for `get_local_response_loss_masks` (its arguments in this order)."""
    return get_local_response_loss_masks(
        total_lengths, response_lengths, loss_masks, qkv_format, max_seq_lens
    )


def get_sum_of_sample_mean(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    calculate_per_token_loss: bool = False,
    qkv_format: str = "thd",
    max_seq_lens: list[int] | None = None,
    *,
    denominators: Sequence[torch.Tensor] | torch.Tensor | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A reducer of a flat tensor over the samples' response tokens, one after another:
    sum_i (x_i * mask_i).sum() / max(denominator_i, 1), or with `calculate_per_token_loss`
    sum_i (x_i * mask_i).sum() (the caller divides by the token count)."""
    if denominators is None:
        denominators = [mask.sum() for mask in loss_masks]
    lengths = [int(n) for n in response_lengths]

    def masked_sums(x: torch.Tensor) -> list[torch.Tensor]:
        parts = x.split(lengths, dim=0)
        return [(x_i * mask_i).sum() for x_i, mask_i in zip(parts, loss_masks, strict=True)]

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        sums = masked_sums(x)
        return sum(
            s / torch.clamp_min(torch.as_tensor(d, device=s.device), 1)
            for s, d in zip(sums, denominators, strict=True)
        )

    def sum_of_token(x: torch.Tensor) -> torch.Tensor:
        return sum(masked_sums(x))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean
