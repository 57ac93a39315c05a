"""The engine's components, built once from EngineConfig and shared by every route.

EngineCore owns the model runner, the scheduler thread, the weight update groups and the
engine RNG (which seeds requests that carry no sampling_seed, so a whole engine run is
reproducible under --seed). Routes get it from `app.state.core`; nothing is global.

`new_batch` is the one way the running batch is built from the flags: the pool sized by
kv/sizing.py (--max-total-tokens, --mem-fraction-static), the context capped at the pool,
CUDA graphs on a GPU. The Scheduler takes that batch; tests build theirs the same way
(tests/support/engine_scheduler.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from millstream.common import tensor_share
from millstream.common.fencing import FenceGate

from .config import EngineConfig
from .executor.model_runner import ModelRunner
from .kv.sizing import pool_size
from .kv.token_pool import TokenPool
from .paged_batch import PagedBatch
from .scheduler import Scheduler
from .weights import NamedTensors, UpdateGroups, WeightLoader

log = logging.getLogger(__name__)


def new_batch(runner: ModelRunner, config: EngineConfig) -> PagedBatch:
    """The running batch `millstream engine` runs with these flags: --max-running-requests
    rows over a pool of kv/sizing.py's size (on a GPU allocated at once, on the CPU growing
    to its limit), each row up to --context-length (the model's by default) or the pool,
    whichever is less; on a GPU its CUDA graphs, not captured yet."""
    model_config, dtype, device = runner.model.config, runner.dtype, runner.device
    size = pool_size(
        model_config,
        dtype,
        device,
        max_total_tokens=config.max_total_tokens,
        mem_fraction=config.mem_fraction_static,
    )
    pool = TokenPool(model_config, size.capacity, dtype, device, limit=size.limit)
    graphs = None
    if device.type == "cuda" and not config.disable_cuda_graph:
        graphs = config.cuda_graph_max_bs or config.max_running_requests
    context_length = config.context_length or runner.context_length
    batch = PagedBatch(
        runner.model,
        pool,
        max_rows=config.max_running_requests,
        context_length=min(context_length, pool.limit),
        cuda_graph_max_bs=graphs,
    )
    log.info(
        "KV token pool: %d tokens (%.1f MiB) on %s%s, shared by up to %d requests of up to %d "
        "tokens; CUDA graphs: %s",
        pool.capacity,
        pool.nbytes / 2**20,
        device,
        f", growing up to {pool.limit}" if pool.limit > pool.capacity else "",
        batch.max_rows,
        batch.context_length,
        f"batch sizes {batch.graphs.sizes}, key buckets {batch.graphs.buckets}"
        if batch.graphs
        else "off",
    )
    return batch


class EngineCore:
    def __init__(self, config: EngineConfig):
        assert config.model_path is not None
        self.config = config
        self.fences = FenceGate()  # a run's older trainer is refused (common/fencing.py)
        self.runner = ModelRunner(
            config.model_path, config.dtype, config.device, fp8_gemm=config.fp8_gemm
        )
        batch = new_batch(self.runner, config)
        if batch.graphs is not None:
            batch.graphs.capture_all()
        self.scheduler = Scheduler(self.runner, batch, weight_version=config.weight_version)
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
