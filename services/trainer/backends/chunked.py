"""Token log-probs without the whole [positions, vocabulary] logits (`--log-probs-chunk-size C`).

With a large vocabulary the logits of every response position are the peak of a GRPO step: a
Qwen2-0.5B micro-batch of 64 x 512 positions holds 64 * 512 * 151936 logits, 20 GB in fp32, and
as much again for their log-softmax. Here the model's body runs once and stops at the final
hidden states of the response positions ([B, T, H]); the output layer, the upcast to fp32, the
log-softmax, the target's gather and the entropy then run on C positions at a time, each chunk
under activation checkpointing: the forward keeps only each position's log-prob and entropy,
and the backward recomputes one chunk's logits at a time. The values are the whole
computation's, up to the order of float sums:

    logits_CV = h_CH @ W_VH^T (+ b)         / temperature, in fp32
    lse_C     = logsumexp(logits_CV)
    logp_C    = logits_CV[target] - lse_C
    entropy_C = lse_C - sum_v softmax(logits_CV)_v * logits_CV_v

Used for Hugging Face causal LMs whose logits are `lm_head(final hidden state)` (Llama, Qwen2,
Qwen3, Mistral, ...); a model that scales or soft-caps its logits, or whose head is sharded or
wrapped (FSDP2, DDP: their forward runs the collectives), is computed whole (`output_layer`
None), and so are the Megatron backend's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# config keys of models whose logits are not lm_head(hidden) alone (Gemma 2, Cohere, Granite)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output layer when its logits are exactly that layer on the body's final
    hidden states, and both can be called apart; else None."""
    head = getattr(model, "lm_head", None)
    body = getattr(model, "model", None)
    if not isinstance(head, torch.nn.Linear) or not isinstance(body, torch.nn.Module):
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in _LOGIT_TRANSFORMS):
        return None
    from torch.distributed.tensor import DTensor

    if isinstance(head.weight, DTensor):
        return None
    return head


def final_hidden(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """[R, S, H] final hidden states (after the final norm) of the model's body."""
    return model.model(**inputs).last_hidden_state


def _chunk(
    h_CH: torch.Tensor,
    target_C: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_CV = F.linear(h_CH, weight, bias)
    logits_CV = logits_CV.to(torch.promote_types(logits_CV.dtype, torch.float32)) / temperature
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    logp_C = logits_CV.gather(-1, target_C[:, None]).squeeze(-1) - lse_C
    if not with_entropy:
        return logp_C, logp_C.new_empty(0)
    p_CV = torch.exp(logits_CV - lse_C[:, None])
    return logp_C, lse_C - (p_CV * logits_CV).sum(-1)


def token_logprobs(
    hidden_BTH: torch.Tensor,
    head: torch.nn.Linear,
    target_BT: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp_BT, entropy_BT or None) of `target_BT` under `head` applied to `hidden_BTH`,
    `chunk` positions at a time (module docstring)."""
    B, T, H = hidden_BTH.shape
    h_NH, target_N = hidden_BTH.reshape(B * T, H), target_BT.reshape(B * T)
    grad = torch.is_grad_enabled() and (hidden_BTH.requires_grad or head.weight.requires_grad)
    logps, entropies = [], []
    for start in range(0, B * T, chunk):
        args: tuple[Any, ...] = (
            h_NH[start : start + chunk], target_N[start : start + chunk], head.weight,
            head.bias, temperature, with_entropy,
        )  # fmt: skip
        if grad:  # keep the chunk's log-probs only; its logits come back in the backward
            logp_C, entropy_C = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            logp_C, entropy_C = _chunk(*args)
        logps.append(logp_C)
        entropies.append(entropy_C)
    logp_BT = torch.cat(logps).reshape(B, T)
    return logp_BT, torch.cat(entropies).reshape(B, T) if with_entropy else None
