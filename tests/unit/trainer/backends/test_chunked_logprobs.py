"""--log-probs-chunk-size: the output layer and log-softmax run on a few positions at a time
(backends/chunked.py), with the whole computation's log-probs, entropy and gradients."""

from __future__ import annotations

import pytest
import torch

from millstream.common.config import parse_run_config
from millstream.trainer.backends import chunked
from millstream.trainer.backends.base import TrainSample
from millstream.trainer.backends.torch_backend import TorchBackend


def _cfg(*extra: str):
    return parse_run_config(
        ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--lr", "1e-2",
         "--rollout-temperature", "0.8", "--entropy-coef", "0.01", *extra]
    )  # fmt: skip


def _samples() -> list[TrainSample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(5):
        n = 2 + 2 * k
        tokens = torch.randint(3, 60, (3 + n,), generator=g).tolist()
        out.append(TrainSample(tokens=tokens, prompt_len=3, loss_mask=[1] * n,
                               rollout_logprobs=[-4.0] * n, reward=float(k % 3) - 1.0))  # fmt: skip
    return out


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunks_give_the_whole_computations_numbers(tiny_model_dir, chunk):
    whole = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=1)
    parts = TorchBackend(_cfg("--log-probs-chunk-size", str(chunk)), tiny_model_dir,
                         ref_dir=None, total_steps=1)  # fmt: skip
    assert chunked.output_layer(parts.model) is parts.model.lm_head
    samples = _samples()
    want = whole._logprobs(whole.model, samples, True)
    got = parts._logprobs(parts.model, samples, True)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # One training step: the same loss, entropy and every parameter's gradient.
    m_whole = whole.accumulate_gradients(samples, whole.prepare([samples]).select(range(5)))
    m_parts = parts.accumulate_gradients(samples, parts.prepare([samples]).select(range(5)))
    assert m_parts["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)
    assert m_parts["entropy_loss"] == pytest.approx(m_whole["entropy_loss"], rel=1e-5)
    for (name, a), b in zip(whole.model.named_parameters(), parts.model.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_chunk_never_holds_more_than_its_positions_logits(tiny_model_dir):
    """The point of it: no tensor of all the positions' logits exists, forward or backward."""
    backend = TorchBackend(_cfg("--log-probs-chunk-size", "4"), tiny_model_dir, ref_dir=None,
                           total_steps=1)  # fmt: skip
    vocab = backend.model.config.vocab_size
    widest = 0
    real_linear = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        nonlocal widest
        out = real_linear(x, weight, bias)
        if out.shape[-1] == vocab:
            widest = max(widest, out.numel() // vocab)
        return out

    samples = _samples()
    prepared = backend.prepare([samples]).select(range(5))
    torch.nn.functional.linear = spy
    try:
        backend.accumulate_gradients(samples, prepared)
    finally:
        torch.nn.functional.linear = real_linear
    assert 0 < widest <= 4, widest  # the output layer saw 4 positions at most at once
    assert sum(s.response_len for s in samples) > 4


def test_models_whose_logits_are_more_than_the_head_are_computed_whole(tiny_model_dir):
    backend = TorchBackend(_cfg(), tiny_model_dir, ref_dir=None, total_steps=1)
    model = backend.model
    model.config.final_logit_softcapping = 30.0
    assert chunked.output_layer(model) is None
    model.config.final_logit_softcapping = None
    assert chunked.output_layer(model) is model.lm_head
    assert chunked.output_layer(torch.nn.Linear(2, 2)) is None


def test_a_chunk_size_of_zero_is_refused():
    with pytest.raises(SystemExit):
        _cfg("--log-probs-chunk-size", "0")
