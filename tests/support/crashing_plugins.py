"""Plugins with a bug, for the tests of "a crashing plugin fails fast and loud"
(common/plugin_errors.py, trainer/observe/plugin_failures.py), Miles' signatures:

--custom-rm-path tests.support.crashing_plugins.raising_reward
--custom-generate-function-path tests.support.crashing_plugins.raising_generate
--dynamic-sampling-filter-path tests.support.crashing_plugins.filter_returns_a_string

Each raises from a helper, so a traceback shows more than one of the plugin's frames.
"""

from __future__ import annotations

from typing import Any

from millstream.compat.miles import Sample

REWARD_MESSAGE = "the reward table has no entry 'arith'"
GENERATE_MESSAGE = "generate: sampling_params lacks 'temperature_schedule'"


def _lookup(table: dict[str, float], key: str) -> float:
    if key not in table:
        raise LookupError(REWARD_MESSAGE)
    return table[key]


def raising_reward(args: Any, sample: Sample) -> float:
    return _lookup({}, "arith")


def _schedule(params: dict[str, Any]) -> float:
    raise ValueError(GENERATE_MESSAGE)


async def raising_generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    sample.metadata["temperature"] = _schedule(sampling_params)
    return sample


async def generate_returns_a_dict(args: Any, sample: Sample, sampling_params: dict) -> Any:
    return {"text": "not a Sample"}


def filter_returns_a_string(args: Any, samples: list[Sample], **kwargs: Any) -> str:
    return "keep"


def raising_rollout(group: Any, cfg: Any, client: Any) -> Any:
    raise RuntimeError("rollout function bug")


def raising_buffer_filter(args: Any, rollout_id: Any, buffer: list, num_samples: int) -> list:
    raise IndexError("buffer filter bug")


def buffer_filter_returns_an_int(args: Any, rollout_id: Any, buffer: list, num_samples: int) -> Any:
    return 3


async def router_down_generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    """What Miles' `post` raises once its retries are spent: the router's failure."""
    import httpx

    raise httpx.ConnectError("All connection attempts failed")


def unreachable_verifier(args: Any, sample: Sample) -> float:
    raise ConnectionError("verifier at 10.0.0.9:8000 refused the connection")
