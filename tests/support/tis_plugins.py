"""TIS/RS functions with Miles' --custom-tis-function-path signature, for the loss tests.

`clamp_and_reject`: weight each token by its train/rollout ratio clamped at 2, and reject
(mask out) tokens whose ratio is above 5. `mismatch_is`: the shape of Miles'
examples/infra_features/train_infer_mismatch_helper/mis.py, written small: its settings come
from --custom-config-path (args.tis_level, args.tis_mode, args.use_rs, ...), none of which is
a flag. `mismatch_is_with_cp`: the same weights in the shape of that file's
`compute_mis_weights_with_cp`, the function Miles' run-qwen3-4b-mis.sh passes: its signature,
its import of Miles' cp_utils inside the body, and its calls (gather each sample's logprobs
over the context parallel group, weigh whole sequences, slice this rank's share back).
`recording`: vanilla TIS that keeps what it was called with.
"""

from __future__ import annotations

from typing import Any

import torch

CALLS: list[dict[str, Any]] = []


def clamp_and_reject(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_):
    ratios = [torch.exp(t - r) for t, r in zip(train_log_probs, rollout_log_probs, strict=True)]
    weights = torch.cat(ratios).clamp(max=2.0)
    masks = [m * (x <= 5.0).to(m.dtype) for m, x in zip(loss_masks, ratios, strict=True)]
    return pg_loss * weights, masks, {"ratio": torch.cat(ratios)}


def _level(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """One sample's log-ratio per token at `level` (token, sequence: the sum, geometric: the
    mean over its trained tokens), as mis.py aggregates it."""
    if level == "token":
        return log_ratio
    total = (log_ratio * mask).sum()
    if level == "sequence":
        return total.expand_as(log_ratio)
    if level == "geometric":
        return (total / mask.sum().clamp(min=1)).expand_as(log_ratio)
    raise ValueError(f"unknown level {level!r}")


def _mis_weights(
    args, train_log_probs, rollout_log_probs, loss_masks
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """Per sample: the IS weight of each token, the mask after rejection, and the metrics
    (one tensor per sample), from whole sequences' logprobs."""
    upper = args.tis_upper_bound
    lower = args.tis_lower_bound if args.tis_lower_bound is not None else 1.0 / upper
    rs_lower = args.rs_lower_bound if args.rs_lower_bound is not None else lower
    rs_upper = args.rs_upper_bound if args.rs_upper_bound is not None else upper
    weights, masks, kl = [], [], []
    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks, strict=True):
        mask = mask.float()
        diff = train - rollout
        kl.append(rollout - train)
        w = torch.exp(_level(diff, mask, args.tis_level).clamp(-20.0, 20.0))
        keep = mask.clone()
        if args.tis_mode == "truncate":
            w = w.clamp(max=upper)
        elif args.tis_mode == "clip":
            w = w.clamp(lower, upper)
        elif args.tis_mode == "mask":
            keep = keep * ((w >= lower) & (w <= upper)).float()
        else:
            raise ValueError(f"unknown tis_mode {args.tis_mode!r}")
        if args.use_rs:
            rs = torch.exp(_level(diff, mask, args.rs_level).clamp(-20.0, 20.0))
            keep = keep * ((rs >= rs_lower) & (rs <= rs_upper)).float()
            veto = args.rs_veto_threshold
            if veto is not None and bool(
                ((diff < torch.log(torch.tensor(veto))) & (mask > 0)).any()
            ):
                keep = torch.zeros_like(keep)
        weights.append(w * mask)
        masks.append(keep)
    return weights, masks, {"kl": kl, "weight": weights}


def mismatch_is(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **_
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    weights, masks, metrics = _mis_weights(args, train_log_probs, rollout_log_probs, loss_masks)
    flat = {f"mis_{name}": torch.cat(values) for name, values in metrics.items()}
    return pg_loss * torch.cat(weights), masks, flat


def mismatch_is_with_cp(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    # Imported here, as mis.py does, so that the module loads where Miles' backends do not.
    from miles.backends.training_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    qkv_format = args.qkv_format
    max_seq_lens = kwargs.get("max_seq_lens")
    if qkv_format == "bshd":
        assert max_seq_lens is not None, "bshd needs max_seq_lens"

    def padded_len(i: int) -> int | None:
        return max_seq_lens[i] if max_seq_lens is not None else None

    def whole(values: list[torch.Tensor]) -> list[torch.Tensor]:
        return [
            all_gather_with_cp(v, total_lengths[i], response_lengths[i], qkv_format, padded_len(i))
            for i, v in enumerate(values)
        ]

    def this_ranks(values: list[torch.Tensor]) -> torch.Tensor:
        shares = [
            slice_log_prob_with_cp(
                v, total_lengths[i], response_lengths[i], qkv_format, padded_len(i)
            )
            for i, v in enumerate(values)
        ]
        return torch.cat(shares, dim=0)

    weights, masks, metrics = _mis_weights(
        args, whole(train_log_probs), whole(rollout_log_probs), loss_masks
    )
    flat = {f"mis_{name}": this_ranks(values) for name, values in metrics.items()}
    return pg_loss * this_ranks(weights), masks, flat


def recording(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    CALLS.append(
        {
            "args": args,
            "pg_loss": pg_loss.detach().clone(),
            "train_log_probs": [t.clone() for t in train_log_probs],
            "rollout_log_probs": [t.clone() for t in rollout_log_probs],
            "loss_masks": [m.clone() for m in loss_masks],
            **kwargs,
        }
    )
    tis = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    return pg_loss * tis.clamp(max=args.tis_clip), loss_masks, {"seen": torch.ones_like(tis)}


def wrong_shape(args, *, pg_loss, loss_masks, **_):
    return pg_loss[:-1], loss_masks, {}
