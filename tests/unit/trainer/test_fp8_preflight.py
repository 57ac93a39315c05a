"""FP8 rollout and the trainer (docs/fp8.md): an FP8 --hf-checkpoint is what the engines serve,
the actor trains --ref-load's full-precision weights, and an FP8 --ref-load (a KL anchor of
FP8-rounded weights) is refused before anything starts."""

from __future__ import annotations

from typing import Any

import pytest

from millstream.common.config import ConfigError
from millstream.trainer import build, preflight
from tests.support.tiny_job import arith_flags
from tests.unit.engine.quant.test_fp8 import make_fp8_copy
from tests.unit.trainer.test_preflight import ARITH, _assert_refused, _cfg, _cli, _with

MODEL = str(ARITH / "model")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_fp8_copy(tmp_path_factory.mktemp("arith-fp8")))


def test_an_fp8_ref_load_is_refused_naming_the_kl_anchor(fp8_dir, tmp_path):
    proc, run_dir = _cli(tmp_path, arith_flags("--ref-load", fp8_dir, "--use-kl-loss"))
    _assert_refused(proc, run_dir, "--ref-load")
    assert "is an FP8 checkpoint" in proc.stderr and "KL anchor" in proc.stderr
    # whether or not a KL term reads it, and whatever --hf-checkpoint is
    with pytest.raises(ConfigError, match=rf"^--ref-load {fp8_dir} is an FP8 checkpoint"):
        preflight.check(_cfg(*arith_flags("--ref-load", fp8_dir)))
    fp8_both = _with(arith_flags("--ref-load", fp8_dir), "--hf-checkpoint", fp8_dir)
    with pytest.raises(ConfigError, match=r"^--ref-load"):
        preflight.check(_cfg(*fp8_both))


def test_an_fp8_hf_checkpoint_needs_a_full_precision_ref_load(fp8_dir, tmp_path):
    argv = _with(arith_flags(), "--hf-checkpoint", fp8_dir)
    with pytest.raises(ConfigError, match=rf"^--hf-checkpoint {fp8_dir} is an FP8 checkpoint"):
        preflight.check(_cfg(*argv))
    with pytest.raises(ConfigError, match=r"^--ref-load .* is not a Hugging Face model dir"):
        preflight.check(_cfg(*argv, "--ref-load", str(tmp_path)))
    preflight.check(_cfg(*argv, "--ref-load", MODEL))  # Miles' BF16 train + FP8 rollout
    assert preflight.fp8_checkpoint(fp8_dir)
    assert not preflight.fp8_checkpoint(MODEL)
    assert not preflight.fp8_checkpoint(str(tmp_path)) and not preflight.fp8_checkpoint(None)


def test_the_actor_and_the_reference_train_from_ref_load(fp8_dir, monkeypatch):
    made: dict[str, Any] = {}

    class Recorder:
        def __init__(self, cfg: Any, actor: str, **dirs: Any):
            made.update(actor=actor, **dirs)

    monkeypatch.setattr(build, "TorchBackend", Recorder)
    argv = _with(arith_flags("--ref-load", MODEL, "--use-kl-loss"), "--hf-checkpoint", fp8_dir)
    build.build_backend(_cfg(*argv), total_rollouts=1)
    assert (made["actor"], made["ref_dir"]) == (MODEL, MODEL)
    build.build_backend(_cfg(*arith_flags("--ref-load", "/elsewhere")), total_rollouts=1)
    assert made["actor"] == MODEL  # a full-precision --hf-checkpoint is still the actor's
