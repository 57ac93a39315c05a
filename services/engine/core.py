"""The engine's components, built once from EngineConfig and shared by every route.

EngineCore owns the model runner, the scheduler thread, the weight update groups and the
engine RNG (which seeds requests that carry no sampling_seed, so a whole engine run is
reproducible under --seed). Routes get it from `app.state.core`; nothing is global.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from millstream.common import tensor_share
from millstream.common.errors import MillstreamError

from .config import DEFAULT_MEM_FRACTION, EngineConfig
from .kv_batch import RunningBatch
from .kv_pool import KVPool, PoolBatch
from .model_runner import ModelRunner, kv_token_budget
from .scheduler import Scheduler
from .weights import NamedTensors, UpdateGroups, WeightLoader

log = logging.getLogger(__name__)

MIN_POOL_COLUMNS = 16


def running_batch(config: EngineConfig, runner: ModelRunner) -> tuple[Any, int | None]:
    """The running batch --kv-cache asks for, and the context length it allows (None: the
    scheduler's default). A static pool has --max-running-requests slots of W columns: W
    from --max-total-tokens when given, else from --mem-fraction-static on a GPU, else
    --context-length (or the model's); it caps the context length at W."""
    device = runner.device
    kind = config.kv_cache
    if kind == "auto":
        kind = "static" if device.type == "cuda" else "dynamic"
    if kind == "dynamic":
        return RunningBatch(), config.context_length
    slots = config.max_running_requests
    context = config.context_length or runner.context_length
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    elif device.type == "cuda":
        fraction = config.mem_fraction_static or DEFAULT_MEM_FRACTION
        tokens = kv_token_budget(runner.model.config, runner.dtype, device, fraction)
    else:
        tokens = slots * context
    width = min(context, tokens // slots)
    if width < MIN_POOL_COLUMNS:
        raise MillstreamError(
            f"the static KV cache would hold {width} tokens per request ({tokens} tokens for "
            f"{slots} requests): lower --max-running-requests or give it more memory "
            "(--mem-fraction-static, --max-total-tokens)"
        )
    pool = KVPool(runner.model.config, slots, width, runner.dtype, device)
    graphs = None
    if device.type == "cuda" and not config.disable_cuda_graph:
        graphs = config.cuda_graph_max_bs or slots
    batch = PoolBatch(runner.model, pool, cuda_graph_max_bs=graphs)
    log.info(
        "static KV cache: %d slots x %d tokens, %.1f MiB on %s; CUDA graphs: %s",
        slots,
        width,
        pool.nbytes / 2**20,
        device,
        f"batch sizes {batch.graphs.sizes}" if batch.graphs else "off",
    )
    return batch, width


class EngineCore:
    def __init__(self, config: EngineConfig):
        assert config.model_path is not None
        self.config = config
        self.runner = ModelRunner(
            config.model_path, config.dtype, config.device, fp8_gemm=config.fp8_gemm
        )
        batch, context_length = running_batch(config, self.runner)
        if isinstance(batch, PoolBatch) and batch.graphs is not None:
            batch.graphs.capture_all()
        self.scheduler = Scheduler(
            self.runner,
            max_running_requests=config.max_running_requests,
            max_total_tokens=config.max_total_tokens,
            context_length=context_length,
            weight_version=config.weight_version,
            batch=batch,
        )
        self.groups = UpdateGroups(config.weight_update_timeout, self.runner.device)
        self.loader = WeightLoader(self.runner.model)
        self.started_at = time.time()
        self._rng = random.Random(config.seed)
        self._placement: dict[str, Any] | None = None
        # The trainer's shared-memory bucket files, kept mapped between weight updates.
        self.mappings = tensor_share.Mappings()

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def placement(self) -> dict[str, Any]:
        """Where the model computes (common/tensor_share.py): host, device, GPU."""
        if self._placement is None:
            self._placement = tensor_share.placement(self.runner.device)
        return self._placement

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def fresh_seed(self) -> int:
        return self._rng.getrandbits(63)

    async def apply_weights(
        self, tensors: NamedTensors, weight_version: str | None, abort_all: bool
    ) -> None:
        """Check `tensors` against the model, then copy them in between two steps."""
        self.loader.check(tensors)
        future = self.scheduler.update_weights(
            lambda: self.loader.copy_in(tensors), weight_version, abort_all
        )
        await asyncio.wrap_future(future)
