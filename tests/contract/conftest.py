"""The contract tier: SGLang's own package judges what millstream sends an SGLang server.

`make test` runs this folder in a second pytest with `.venv/sglang` (scripts/bootstrap.sh,
scripts/sglang-contract.txt: SGLang pinned, installed without its GPU dependencies) first on
the path and MILLSTREAM_CONTRACT=1; the main run leaves the folder out (tests/conftest.py),
because an importable `sglang` makes the launcher start SGLang servers.

SGLang's modules are imported here once, with the one stand-in they need on this machine
(torchvision) and their own import-time warnings left out (tests/support/sglang_contract.py,
which the main run's SGLang stand-in shares); what the tests then call runs under -W error.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if os.environ.get("MILLSTREAM_CONTRACT") == "1":
    if importlib.util.find_spec("sglang") is None:
        raise pytest.UsageError(
            "MILLSTREAM_CONTRACT=1 but sglang is not importable: run scripts/bootstrap.sh and "
            "put .venv/sglang on PYTHONPATH (make test does)"
        )
    from tests.support import sglang_contract

    sglang_contract.load(
        "sglang.srt.managers.io_struct",
        "sglang.srt.server_args",
        "sglang.srt.utils",
        "sglang.srt.weight_sync.tensor_bucket",
    )
