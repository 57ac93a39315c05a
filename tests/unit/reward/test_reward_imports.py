"""The reward worker imports light: no torch or transformers, and Celery only when asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
import millstream.reward.main
import millstream.reward.worker
import millstream.reward.grpc_service
from millstream.reward.math_utils import warm_up
warm_up()  # math-verify and sympy, loaded
heavy = sorted(m for m in ("torch", "transformers", "celery") if m in sys.modules)
print(",".join(heavy) or "none")
"""


@pytest.mark.timeout(60)
def test_reward_worker_and_math_verify_do_not_import_torch():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "none"


@pytest.mark.parametrize(
    "flags, warm",
    [
        (["--rm-type", "exact"], False),
        (["--rm-type", "f1"], False),
        (["--rm-type", "boxed_exact"], False),
        (["--rm-type", "math"], True),
        (["--rm-type", "deepscaler"], True),
        (["--rm-type", "exact", "--custom-rm-path", "examples.arith.reward.score"], True),
        ([], True),  # the rm_type comes from each sample's metadata: any rule may
    ],
)
def test_math_verify_is_warmed_up_only_for_rewards_that_may_need_it(flags, warm):
    """sympy's import is most of a reward worker's start-up CPU: skipped for instant rules."""
    from millstream.common.config import parse_run_config
    from millstream.reward.main import needs_warm_up

    cfg = parse_run_config(["--hf-checkpoint", "unused", "--rollout-batch-size", "2", *flags])
    assert needs_warm_up(cfg) is warm
