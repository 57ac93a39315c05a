"""--custom-tis-function-path: a function with Miles' TIS signature, called in the loss as Miles
calls it, against the loss computed by hand in float64; Miles' mis.py shape with its settings
from --custom-config-path; through the torch backend; --use-rollout-logprobs."""

from __future__ import annotations

import base64
import math

import pytest
import torch

from millstream.common.config import parse_run_config
from millstream.common.config.algo import AlgoConfig
from millstream.common.errors import MillstreamError
from millstream.compat.miles import make_args
from millstream.trainer.algorithms.loss import Denominator, policy_loss
from millstream.trainer.algorithms.tis import CustomTis
from millstream.trainer.backends.base import TrainSample
from millstream.trainer.backends.torch_backend import TorchBackend
from tests.support import tis_plugins

PLUGINS = "tests.support.tis_plugins"
F64 = torch.float64

# Two samples, responses of 3 and 2 tokens (T = 3), the second's last token masked out of the
# loss by its loss mask; one token's train/rollout ratio is e (> 2: clamped), one e^2.5
# (> 5: rejected).
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]]
OLD = [[-1.1, -0.4, -2.0], [-0.2, -1.0, 0.0]]
ROLLOUT = [[-1.2, -1.4, -2.1], [-2.7, -1.0, 0.0]]
ADV = [[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
LENGTHS = ([3, 2], [5, 4])


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _clipped(logp: float, old: float, adv: float, cfg: AlgoConfig) -> float:
    ratio = math.exp(logp - old)
    high = cfg.eps_clip if cfg.eps_clip_high is None else cfg.eps_clip_high
    return max(-adv * ratio, -adv * min(max(ratio, 1 - cfg.eps_clip), 1 + high))


def _loss(cfg: AlgoConfig, fn, args=None, n_samples: int = 2):
    logp = _t(LOGP).requires_grad_(True)
    tis = CustomTis("test.fn", args, fn=fn)
    loss, metrics = policy_loss(
        logp, _t(OLD), _t(ADV), _t(MASK), cfg, Denominator(n_samples, 4),
        rollout_logp_BT=_t(ROLLOUT), custom_tis=tis, lengths=LENGTHS,
    )  # fmt: skip
    return logp, loss, metrics


def test_a_users_function_gives_the_loss_computed_by_hand():
    cfg = AlgoConfig(use_tis=True)
    logp, loss, metrics = _loss(cfg, tis_plugins.clamp_and_reject)
    expected, ratio_mean = 0.0, 0.0
    for i, n in enumerate(LENGTHS[0]):
        kept, count, ratio_sum = 0.0, sum(MASK[i][:n]), 0.0
        for t in range(n):
            ratio = math.exp(OLD[i][t] - ROLLOUT[i][t])
            ratio_sum += ratio * MASK[i][t]
            if ratio > 5.0:  # rejected: out of the numerator, still in the denominator
                continue
            kept += _clipped(LOGP[i][t], OLD[i][t], ADV[i][t], cfg) * min(ratio, 2.0) * MASK[i][t]
        expected += kept / count / 2
        ratio_mean += ratio_sum / count / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["pg_loss"] == pytest.approx(expected, rel=1e-12)
    # metrics reduce like the loss over the original masks, under train/<name>
    assert metrics["train/ratio"] == pytest.approx(ratio_mean, rel=1e-12)
    loss.backward()
    assert logp.grad[1, 0] == 0.0  # the rejected token trains nothing
    assert logp.grad[0, 1] != 0.0  # the clamped one does, weighted 2


def test_per_token_loss_keeps_the_global_token_count():
    cfg = AlgoConfig(use_tis=True, calculate_per_token_loss=True)
    _, loss, _ = _loss(cfg, tis_plugins.clamp_and_reject)
    total = 0.0
    for i, n in enumerate(LENGTHS[0]):
        for t in range(n):
            ratio = math.exp(OLD[i][t] - ROLLOUT[i][t])
            if ratio <= 5.0:
                total += (
                    _clipped(LOGP[i][t], OLD[i][t], ADV[i][t], cfg) * min(ratio, 2) * MASK[i][t]
                )
    assert loss.item() == pytest.approx(total / 4, rel=1e-12)


def _mis_cfg(tmp_path, yaml_text: str, *flags: str):
    path = tmp_path / "mis.yaml"
    path.write_text(yaml_text)
    return parse_run_config(
        ["--rollout-batch-size", "2", "--custom-tis-function-path", f"{PLUGINS}.mismatch_is",
         "--custom-config-path", str(path), *flags]
    )  # fmt: skip


MIS_YAML = """
use_tis: true            # a flag: sets --use-tis
tis_mode: truncate       # the function's own (our --tis-mode keeps its value)
tis_level: token
tis_upper_bound: 2.0
tis_lower_bound: null
use_rs: true
rs_level: sequence
rs_lower_bound: null
rs_upper_bound: null
rs_veto_threshold: 1.0e-4
"""


def test_a_mis_style_function_reads_its_settings_from_the_custom_config(tmp_path):
    cfg = _mis_cfg(tmp_path, MIS_YAML)
    assert cfg.algo.use_tis and cfg.algo.tis_mode == "tis"
    assert cfg.algo.custom_tis_function == f"{PLUGINS}.mismatch_is"
    args = make_args(cfg)
    assert (args.tis_mode, args.tis_level, args.use_rs, args.rs_level) == (
        "truncate", "token", True, "sequence"
    )  # fmt: skip
    _, loss, metrics = _loss(cfg.algo, tis_plugins.mismatch_is, args)
    # by hand: token weights min(ratio, 2); a sample is rejected (rs, sequence level) when
    # the product of its ratios is outside [1/2, 2]
    expected = 0.0
    for i, n in enumerate(LENGTHS[0]):
        mask = MASK[i][:n]
        log_seq = sum((OLD[i][t] - ROLLOUT[i][t]) * mask[t] for t in range(n))
        if not 0.5 <= math.exp(log_seq) <= 2.0:
            continue
        terms = [
            _clipped(LOGP[i][t], OLD[i][t], ADV[i][t], cfg.algo)
            * min(math.exp(OLD[i][t] - ROLLOUT[i][t]), 2.0) * mask[t]
            for t in range(n)
        ]  # fmt: skip
        expected += sum(terms) / sum(mask) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    kl = sum(
        sum((ROLLOUT[i][t] - OLD[i][t]) * MASK[i][t] for t in range(n)) / sum(MASK[i][:n]) / 2
        for i, n in enumerate(LENGTHS[0])
    )
    assert metrics["train/mis_kl"] == pytest.approx(kl, rel=1e-12)


def test_the_custom_config_can_be_inline_base64_and_a_bad_value_exits_2(tmp_path, capsys):
    inline = "base64:" + base64.b64encode(b"tis_level: geometric\nuse_rs: false\n").decode()
    cfg = parse_run_config(["--rollout-batch-size", "2", "--custom-config-path", inline])
    assert (make_args(cfg).tis_level, make_args(cfg).use_rs) == ("geometric", False)
    with pytest.raises(SystemExit):
        _mis_cfg(tmp_path, "use_tis: 3\n")
    assert "--custom-config-path" in capsys.readouterr().err


def test_miles_builtin_names_stay_ours_and_a_bad_return_is_named():
    assert AlgoConfig(custom_tis_function_path="icepop_function").tis_mode == "icepop"
    cfg = AlgoConfig(use_tis=True, custom_tis_function_path="my.pkg.vanilla_tis_function")
    assert cfg.tis_mode == "tis" and cfg.custom_tis_function == "my.pkg.vanilla_tis_function"
    with pytest.raises(MillstreamError, match=r"--custom-tis-function-path test\.fn: pg_loss"):
        _loss(AlgoConfig(use_tis=True), tis_plugins.wrong_shape)


def _samples() -> list[TrainSample]:
    return [
        TrainSample(tokens=[10, 11, 12, 13, 14], prompt_len=2, loss_mask=[1, 1, 0],
                    rollout_logprobs=[-1.0, -2.0, -3.0], reward=1.0),
        TrainSample(tokens=[20, 21, 22], prompt_len=2, loss_mask=[1],
                    rollout_logprobs=[-1.5], reward=-1.0),
    ]  # fmt: skip


def _backend(tiny_model_dir, *flags: str) -> TorchBackend:
    cfg = parse_run_config(["--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
                            "--disable-grpo-std-normalization", *flags])  # fmt: skip
    return TorchBackend(cfg, tiny_model_dir, ref_dir=None, total_steps=1)


def test_the_torch_backend_calls_it_with_miles_arguments(tiny_model_dir):
    tis_plugins.CALLS.clear()
    backend = _backend(tiny_model_dir, "--use-tis", "--tis-clip", "1.5", "--micro-batch-size", "2",
                       "--custom-tis-function-path", f"{PLUGINS}.recording")  # fmt: skip
    metrics = backend.train_rollout(_samples(), 1)
    (call,) = tis_plugins.CALLS
    assert call["response_lengths"] == [3, 1] and call["total_lengths"] == [5, 3]
    assert [m.tolist() for m in call["loss_masks"]] == [[1.0, 1.0, 0.0], [1.0]]
    assert [r.tolist() for r in call["rollout_log_probs"]] == [[-1.0, -2.0, -3.0], [-1.5]]
    assert call["pg_loss"].shape == (4,) and call["parallel_state"].cp.size == 1
    assert call["args"].tis_clip == 1.5 and call["max_seq_lens"] is None
    assert metrics["train/seen"] == pytest.approx(1.0)
    tis_plugins.CALLS.clear()


def test_use_rollout_logprobs_makes_the_engines_logprobs_the_old_policy(tiny_model_dir):
    recomputed = _backend(tiny_model_dir).train_rollout(_samples(), 1)
    assert recomputed["ppo_kl"] == 0.0  # one step: the old policy is the current one
    rollout = _backend(tiny_model_dir, "--use-rollout-logprobs").train_rollout(_samples(), 1)
    logp = _backend(tiny_model_dir).logprobs(_samples())
    # ppo_kl = old - logp, per-sample mean over the trained tokens, mean over the samples
    by_hand = ((-1.0 - logp[0][0] + -2.0 - logp[0][1]) / 2 + (-1.5 - logp[1][0])) / 2
    assert rollout["ppo_kl"] == pytest.approx(by_hand.item(), rel=1e-4)
    # the mismatch metrics still compare the trainer's logprobs with the engines'
    assert rollout["train_rollout_logprob_abs_diff"] == pytest.approx(
        recomputed["train_rollout_logprob_abs_diff"], rel=1e-5
    )
