"""The shared-prompt layout: a prompt forwarded once for its samples gives the logprobs and
the gradient of one row per sample (shared_prefix.py)."""

from __future__ import annotations

import pytest
import torch

from millstream.common.config import parse_run_config
from millstream.trainer.backends import batching, shared_prefix
from millstream.trainer.backends.base import TrainSample
from millstream.trainer.backends.forwards import Prepared
from millstream.trainer.backends.torch_backend import TorchBackend


def _sample(prompt: list[int], response: list[int], reward: float = 0.0) -> TrainSample:
    n = len(response)
    return TrainSample(
        tokens=[*prompt, *response], prompt_len=len(prompt), loss_mask=[1] * n,
        rollout_logprobs=[-1.0] * n, reward=reward,
    )  # fmt: skip


def _groups() -> list[TrainSample]:
    """Two prompts with three responses each (lengths 1-4), one prompt alone, interleaved."""
    a, b, c = [5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23]
    return [
        _sample(a, [30, 31, 32], 1.0), _sample(b, [33], -1.0), _sample(a, [34], 0.5),
        _sample(c, [35, 36], 0.0), _sample(b, [37, 38, 39, 40], 1.0), _sample(a, [41, 42], -0.5),
        _sample(b, [43, 44], 0.25),
    ]  # fmt: skip


def _backend(model_dir, *flags: str) -> TorchBackend:
    cfg = parse_run_config(
        ["--rollout-batch-size", "7", "--n-samples-per-prompt", "1", "--lr", "1e-2",
         "--micro-batch-size", "7", *flags]
    )  # fmt: skip
    return TorchBackend(cfg, model_dir, ref_dir=None, total_steps=4)


def test_the_layout_puts_each_prompt_once_before_its_responses():
    samples = _groups()
    rows = shared_prefix.group_by_prompt(samples)
    assert rows == [[0, 2, 5], [1, 4, 6], [3]]
    lay = shared_prefix.layout(samples, rows, T=4)
    assert lay.ids[0] == [5, 6, 7, 8, 9, 30, 31, 32, 34, 41, 42]
    assert lay.positions[0] == [0, 1, 2, 3, 4, 5, 6, 7, 5, 5, 6]
    assert lay.segments[1] == [0, 0, 0, 1, 2, 2, 2, 2, 3, 3, -1]
    assert lay.row_of == [0, 1, 0, 2, 1, 0, 1]
    # The first response token is predicted at the prompt's last position, the rest at the
    # sample's own previous one.
    assert lay.cols[0] == [4, 5, 6, 0] and lay.cols[2] == [4, 0, 0, 0]
    assert lay.cols[5] == [4, 9, 0, 0]
    mask = lay.mask()[1, 0]  # row b: prompt 0-2, responses at 3, 4-7, 8-9, padding 10
    assert mask[5].tolist() == [True] * 3 + [False] + [True] * 2 + [False] * 5
    assert mask[9].tolist() == [True] * 3 + [False] * 5 + [True] * 2 + [False]
    assert mask[10].tolist() == [False] * 10 + [True]  # padding: never an empty row
    additive = lay.mask(torch.float32)[1, 0]
    assert additive[5, 3] == torch.finfo(torch.float32).min and additive[5, 4] == 0


def test_packed_the_groups_share_one_row_and_never_see_each_other():
    samples = _groups()
    groups = shared_prefix.group_by_prompt(samples)
    lay = shared_prefix.layout(samples, groups, T=4, packed=True)
    assert len(lay.ids) == 1 and lay.row_of == [0] * 7
    assert lay.ids[0][:11] == [5, 6, 7, 8, 9, 30, 31, 32, 34, 41, 42]
    assert lay.positions[0][11:14] == [0, 1, 2]  # prompt b starts again at 0
    assert lay.cols[1] == [13, 0, 0, 0]  # b's last prompt token is at 13
    mask = lay.mask()[0, 0]
    assert not mask[14, :11].any() and mask[14, 11:14].all()  # b's first response: b's prompt
    assert len(lay.ids[0]) == sum(shared_prefix.row_length(samples, g) for g in groups)


def test_packing_counts_a_shared_prompt_once():
    samples = _groups()
    lengths = [len(s.tokens) for s in samples]  # 8 4 6 6 7 7 5: 43 tokens
    prompts = [tuple(s.tokens[: s.prompt_len]) for s in samples]
    plain = batching.pack_by_tokens(lengths, 20)
    shared = batching.pack_by_tokens(lengths, 20, prompts)
    assert len(shared) < len(plain)
    for mb in shared:  # the tokens the layout runs fit the cap
        groups = shared_prefix.group_by_prompt([samples[i] for i in mb])
        run = sum(shared_prefix.row_length([samples[i] for i in mb], g) for g in groups)
        assert run <= 20 or len(mb) == 1
    assert sorted(i for mb in shared for i in mb) == list(range(7))


def test_the_layout_is_picked_only_where_it_computes_less():
    short = [_sample([1] * 200, [2] * 4) for _ in range(8)]
    rows = shared_prefix.group_by_prompt(short)
    assert shared_prefix.cheaper(short, rows, hidden=4096, intermediate=11008)
    # Long responses: one row holds all of them, and attention grows with its square.
    long = [_sample([1] * 200, [2] * 1000) for _ in range(8)]
    rows = shared_prefix.group_by_prompt(long)
    assert not shared_prefix.cheaper(long, rows, hidden=4096, intermediate=11008)
    alone = [_sample([k], [2, 3]) for k in range(4)]
    assert not shared_prefix.cheaper(
        alone, shared_prefix.group_by_prompt(alone), hidden=64, intermediate=128
    )


@pytest.mark.parametrize(
    ("attention", "flags"),
    [
        ("sdpa", ()),
        ("eager", ()),
        ("sdpa", ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "24")),  # packed
    ],
)
def test_shared_prompts_give_the_logprobs_and_gradient_of_one_row_each(
    tiny_model_dir, attention, flags
):
    shared = _backend(tiny_model_dir, *flags)
    plain = _backend(tiny_model_dir, "--no-shared-prefix", *flags)
    for backend in (shared, plain):
        backend.model.config._attn_implementation = attention
    shared.prompt_mask = shared._shared_prompt_mask()
    assert shared.prompt_mask == {"sdpa": "bool", "eager": "float"}[attention]
    assert plain.prompt_mask is None
    samples = _groups()
    assert shared._prompt_rows(samples) is not None  # this batch is laid out shared
    torch.testing.assert_close(
        torch.cat(shared.logprobs(samples)), torch.cat(plain.logprobs(samples))
    )
    advantages = [torch.full((s.response_len,), s.reward) for s in samples]
    for backend in (shared, plain):
        backend.optimizer.zero_grad(set_to_none=True)
        backend.accumulate_gradients(samples, Prepared(advantages=advantages))
    for (name, p), q in zip(shared.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_model_that_drops_the_mask_keeps_one_row_per_sample(tiny_model_dir, monkeypatch):
    backend = _backend(tiny_model_dir)
    assert backend.prompt_mask == "bool"
    # An attention that ignores a custom mask (causal only) fails the probe: there the
    # responses would see each other.
    original = torch.nn.functional.scaled_dot_product_attention

    def causal_only(q, k, v, attn_mask=None, **kwargs):
        return original(q, k, v, **{**kwargs, "is_causal": True})

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", causal_only)
    assert backend._shared_prompt_mask() is None
