"""Miles' cp_utils stood in for (compat/miles/cp_utils.py): a CP-aware TIS function in the shape
of Miles' mis.py `compute_mis_weights_with_cp` (tests/support/tis_plugins.py), imports and all,
runs unchanged through the loss, the torch backend, and megatron's context parallel ranks, and
gives what the same weights computed without CP give; the stand-in's functions are Miles' at
one CP rank; the rest of `miles.backends` is still refused by name."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from millstream.common.config import parse_run_config
from millstream.compat.miles import install_miles_modules, make_args
from millstream.trainer.algorithms.loss import Denominator, policy_loss
from millstream.trainer.algorithms.tis import CustomTis
from tests.integration.trainer.test_data_parallel import FLAGS, _rank, build_backend
from tests.support.redis_server import free_port
from tests.unit.trainer.algorithms.test_tis_function import (
    ADV,
    LENGTHS,
    LOGP,
    MASK,
    MIS_YAML,
    OLD,
    ROLLOUT,
    _t,
)
from tests.unit.trainer.backends.test_torch_backend import _samples

pytestmark = pytest.mark.timeout(180)

PLUGINS = "tests.support.tis_plugins"
WITH_CP, WITHOUT_CP = f"{PLUGINS}.mismatch_is_with_cp", f"{PLUGINS}.mismatch_is"
# For a tiny random model against rollout logprobs of -1: truncated token-level weights only
# (sequence-level rejection would reject every sample and train nothing).
TRUNCATE_YAML = """
use_tis: true
tis_mode: truncate
tis_level: token
tis_upper_bound: 2.0
tis_lower_bound: null
use_rs: false
rs_level: token
rs_lower_bound: null
rs_upper_bound: null
rs_veto_threshold: null
"""


def _flags(tmp_path: Path, yaml_text: str, path: str) -> list[str]:
    config = tmp_path / "mis.yaml"
    config.write_text(yaml_text)
    return ["--custom-tis-function-path", path, "--custom-config-path", str(config)]


def _loss(tmp_path: Path, path: str):
    """policy_loss with the function at `path`, loaded as the trainer loads it (the plugin
    loader, which installs the miles import hook)."""
    cfg = parse_run_config(["--rollout-batch-size", "2", *_flags(tmp_path, MIS_YAML, path)])
    logp = _t(LOGP).requires_grad_(True)
    loss, metrics = policy_loss(
        logp, _t(OLD), _t(ADV), _t(MASK), cfg.algo, Denominator(2, 4),
        rollout_logp_BT=_t(ROLLOUT), custom_tis=CustomTis(path, make_args(cfg)), lengths=LENGTHS,
    )  # fmt: skip
    loss.backward()
    return loss.item(), metrics, logp.grad


def test_a_cp_aware_tis_function_runs_unchanged_in_the_loss(tmp_path):
    # mismatch_is is checked against the loss by hand in float64 (test_tis_function.py)
    loss, metrics, grad = _loss(tmp_path, WITH_CP)
    want_loss, want_metrics, want_grad = _loss(tmp_path, WITHOUT_CP)
    assert loss == want_loss and metrics == want_metrics and torch.equal(grad, want_grad)
    assert {"train/mis_kl", "train/mis_weight"} <= set(metrics)


def _torch_step(model: Path, flags: list[str]) -> tuple[dict, dict]:
    cfg = parse_run_config([*FLAGS, "--use-tis", *flags])
    backend = build_backend(cfg, str(model))
    metrics = backend.train_rollout(_samples(), 1)
    return metrics, dict(backend.named_weights())


def test_the_torch_backend_trains_with_it(tiny_model_dir, tmp_path):
    metrics, weights = _torch_step(tiny_model_dir, _flags(tmp_path, TRUNCATE_YAML, WITH_CP))
    want_metrics, want_weights = _torch_step(
        tiny_model_dir, _flags(tmp_path, TRUNCATE_YAML, WITHOUT_CP)
    )
    assert metrics == want_metrics and metrics["train/mis_weight"] > 0
    assert all(torch.equal(weights[k], w) for k, w in want_weights.items())


@pytest.mark.long  # megatron's CP ranks: tests/integration/trainer/test_data_parallel.py (tp2-cp2, pp2-cp2)
def test_megatron_context_parallel_ranks_give_the_one_rank_step(tiny_model_dir, tmp_path):
    """Miles' own script runs this function with --context-parallel-size 2. Here the two CP
    ranks gather the sequence before the loss, so the function sees whole responses on each
    and the stand-in's identity is the right gather: the step is the one-rank step's."""
    flags = _flags(tmp_path, TRUNCATE_YAML, WITH_CP)
    megatron = ["--train-backend", "megatron", "--context-parallel-size", "2", "--use-tis"]
    plan = [([*megatron, *flags], False)]
    mp.spawn(_rank, args=(2, free_port(), str(tiny_model_dir), str(tmp_path), plan), nprocs=2)
    metrics = torch.load(tmp_path / "run0-metrics.pt", weights_only=True)
    weights = torch.load(tmp_path / "run0-rank0.pt", weights_only=True)
    want_metrics, want_weights = _torch_step(tiny_model_dir, flags)
    for name in ("loss", "pg_loss", "train/mis_kl", "train/mis_weight"):
        assert metrics[name] == pytest.approx(want_metrics[name], rel=1e-4, abs=1e-6), name
    for key, want in want_weights.items():
        torch.testing.assert_close(weights[key], want, atol=1e-5, rtol=0)


# -- the stand-in --------------------------------------------------------------------------

install_miles_modules()


def test_gather_and_slice_are_the_identity_on_whole_responses():
    from miles.backends.training_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    assert all_gather_with_cp(logp, 7, 3, None, None) is logp  # args.qkv_format unset: None
    assert slice_log_prob_with_cp(logp, 7, 3, "bshd", 16) is logp
    values = [0.1, 0.2, 0.3]
    assert slice_log_prob_with_cp(values, 5, 3) is values  # a list stays a list
    with pytest.raises(
        ValueError, match=r"all_gather_with_cp: got 2 values .* 3 tokens.*CP size 1"
    ):
        all_gather_with_cp(logp[:2], 7, 3)
    with pytest.raises(ValueError, match=r"slice_log_prob_with_cp: got 4 values"):
        slice_log_prob_with_cp([0.0] * 4, 7, 3)


def test_the_loss_masks_and_the_sample_mean_are_miles_at_one_rank():
    from miles.backends.training_utils import cp_utils

    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0])]
    assert cp_utils.get_local_response_loss_masks([5, 4], [3, 2], masks) is masks
    assert cp_utils.slice_loss_masks_for_local_cp(masks, [5, 4], [3, 2]) is masks
    x = torch.tensor([2.0, 100.0, 4.0, 1.0, 3.0], dtype=torch.float64)
    mean = cp_utils.get_sum_of_sample_mean([5, 4], [3, 2], masks)
    assert mean(x).item() == pytest.approx((2 + 4) / 2 + (1 + 3) / 2)
    per_token = cp_utils.get_sum_of_sample_mean([5, 4], [3, 2], masks, True)
    assert per_token(x).item() == pytest.approx(2 + 4 + 1 + 3)
    fixed = cp_utils.get_sum_of_sample_mean(
        [5, 4], [3, 2], masks, denominators=[torch.tensor(4.0), torch.tensor(0.0)]
    )
    assert fixed(x).item() == pytest.approx((2 + 4) / 4 + (1 + 3) / 1)  # clamped at 1


def test_args_qkv_format_is_miles_default():
    args = make_args(parse_run_config(["--rollout-batch-size", "2"]))
    assert args.qkv_format == "thd"


def test_miles_model_side_cp_functions_and_the_rest_of_backends_say_why():
    with pytest.raises(ImportError, match=r"slice_with_cp .* whole sequences here, one CP rank"):
        from miles.backends.training_utils.cp_utils import slice_with_cp  # noqa: F401
    for name in ("miles.backends.training_utils.loss_hub", "miles.backends.megatron_utils"):
        with pytest.raises(ModuleNotFoundError, match=r"stands in for .*cp_utils only") as info:
            importlib.import_module(name)
        assert info.value.name == name
