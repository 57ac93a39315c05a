"""Fixtures shared by every tier: a real redis-server, a tiny model, a clean Redis per test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# As `millstream.cli` does for every service: this process uses gRPC and starts services
# (fork, then exec); gRPC's fork handlers could kill such a child (services/cli.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tests.support.redis_server import RedisServer

# The contract tier needs SGLang's package on the path, which the rest must not see, and the
# live tier a real SGLang server: make test runs each in a pytest of its own
# (tests/contract/conftest.py, tests/sglang_live/conftest.py).
collect_ignore = [
    tier
    for tier, flag in (
        ("contract", "MILLSTREAM_CONTRACT"),
        ("sglang_live", "MILLSTREAM_SGLANG_LIVE"),
    )
    if os.environ.get(flag) != "1"
]


# The unit files of 40 s or more on 2 cores (pytest --durations): collected first, so that
# make test's two workers (pytest-xdist, a file to a worker) do not end with one of them
# running a long file alone. Only the order changes.
FIRST = ("test_data_parallel.py", "test_gpu_check.py", "test_megatron_model.py",
         "test_bf16_parallel.py", "test_megatron_dist.py", "test_transformers_floor.py",
         "test_miles_scripts.py")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The FIRST files first. `@pytest.mark.gpu` tests skip where torch sees no CUDA GPU (CI);
    `make gpu-check` runs them on one. torch is imported only when a collected test carries
    the mark."""
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: files stay whole
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA GPU (make gpu-check runs it on one)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests isolate themselves by run id / flushdb."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, with the database flushed before the test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-style model with a character-level tokenizer, built from a config."""
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path):
    """The engine's model runner on the tiny model (one a module: tests update its weights)."""
    from millstream.engine.executor.model_runner import ModelRunner

    return ModelRunner(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """The tiny model as plain transformers loads it: what the engine must agree with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()
