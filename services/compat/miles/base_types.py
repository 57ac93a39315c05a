"""Miles' `miles.rollout.base_types`: the inputs and outputs of rollout and generate functions.

The generate-function types are live: a --custom-generate-function-path may be Miles' newer
form `async fn(input: GenerateFnInput) -> GenerateFnOutput` (or a class whose instances are),
besides the older `fn(args, sample, sampling_params)`; `load_generate_function(path)` (Miles'
`inference_rollout.compatibility` name) gives either as the newer form. The rollout-function
types (`RolloutFn*`) are here so a module that names them imports; the whole-batch rollout
functions they describe are refused here (package docstring, `--rollout-function-path`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .data_source import DataSource
from .misc import load_function
from .types import Sample

GenerateState = Any  # sglang_rollout.GenerateState, which imports this module

__all__ = [
    "GenerateFnInput",
    "GenerateFnOutput",
    "RolloutFnBaseInput",
    "RolloutFnConstructorInput",
    "RolloutFnEvalInput",
    "RolloutFnEvalOutput",
    "RolloutFnInput",
    "RolloutFnOutput",
    "RolloutFnTrainInput",
    "RolloutFnTrainOutput",
    "call_rollout_fn",
    "load_generate_function",
]


@dataclass(frozen=True)
class RolloutFnConstructorInput:
    args: Any
    data_source: DataSource


@dataclass(frozen=True)
class RolloutFnBaseInput:
    rollout_id: int

    @property
    def evaluation(self) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class RolloutFnTrainInput(RolloutFnBaseInput):
    weight_version: int | None = None  # the engines' weight version; None before the first sync

    @property
    def evaluation(self) -> bool:
        return False


@dataclass(frozen=True)
class RolloutFnEvalInput(RolloutFnBaseInput):
    generate_state: GenerateState | None = None
    weight_version: str | None = None
    hf_dir: str | None = None

    @property
    def evaluation(self) -> bool:
        return True


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


RolloutFnInput = RolloutFnTrainInput | RolloutFnEvalInput
RolloutFnOutput = RolloutFnTrainOutput | RolloutFnEvalOutput


@dataclass(frozen=True)
class GenerateFnInput:
    state: GenerateState
    sample: Sample
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Any:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    samples: Sample | list[Sample]  # one generate may make several (multi-agent, trees)


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool, **kwargs: Any) -> RolloutFnOutput:
    """Miles' older rollout call: a bare answer becomes the matching output type."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(output, RolloutFnTrainOutput | RolloutFnEvalOutput):
        return output
    return RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)


class _OlderGenerateFn:
    """`fn(args, sample, sampling_params[, evaluation])` called as the newer form."""

    def __init__(self, fn: Any):
        self.fn = fn
        self._takes_evaluation = "evaluation" in inspect.signature(fn).parameters

    async def __call__(self, input: GenerateFnInput) -> GenerateFnOutput:
        extra = {"evaluation": input.evaluation} if self._takes_evaluation else {}
        output = await self.fn(input.args, input.sample, input.sampling_params, **extra)
        return output if isinstance(output, GenerateFnOutput) else GenerateFnOutput(samples=output)


def load_generate_function(path: str | None) -> Any:
    """The generate function at `path` as `async fn(GenerateFnInput) -> GenerateFnOutput`: a
    class is instantiated, a function with three or more parameters whose first is not
    `input` is the older form (adapted), any other is taken as it is. None for no path."""
    fn = load_function(path)
    if fn is None:
        return None
    if inspect.isclass(fn):
        return fn()
    params = list(inspect.signature(fn).parameters)
    return _OlderGenerateFn(fn) if len(params) >= 3 and params[0] != "input" else fn
