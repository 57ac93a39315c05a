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
