"""--colocate: the trainer and the engines take turns on one GPU (docs/gpus.md).

One iteration, in Miles' order (--offload-rollout: the engines' turns; --offload-train: the
trainer's):

    engines generate the batch            the trainer's state is in host memory
    1. release   every engine: /release_memory_occupation {kv_cache, weights}
                 (running requests are retracted and wait, new ones queue)
    2. onload    the trainer's parameters, gradients, optimizer state to the GPU
    3. train     the optimizer steps
    4. resume    every engine: /resume_memory_occupation {weights}
    5. sync      the weight sync (CUDA IPC on one GPU: no copy leaves the device)
    6. offload   the trainer's state to host memory
    7. resume    every engine: /resume_memory_occupation {kv_cache}; generation goes on

The KV cache comes back last, so the GPU never holds the trainer's state and a KV cache at
once: the peak is the trainer's step, or the engine's generation, plus the other's weights
during the sync. An engine that fails a release or a resume is reported by name and the run
stops: an engine left half released would hold requests forever.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from millstream.common import threads
from millstream.common.errors import MillstreamError

log = logging.getLogger(__name__)

ALL = ["kv_cache", "weights"]


class Colocation:
    """The turns of one iteration (module docstring); `offload` None: --no-offload-train,
    `release_engines` False: --no-offload-rollout."""

    def __init__(self, weight_sync: Any, offload: Any | None, release_engines: bool):
        self.weight_sync = weight_sync
        self.offload = offload
        self.release_engines = release_engines
        self.seconds = 0.0  # this iteration's time in turns (releases, resumes, moves)

    async def start(self) -> None:
        """Before the first rollout: the engines get the GPU."""
        if self.offload is not None:
            await threads.compute(self.offload.to_host)
        what = []
        if self.offload is not None:
            what.append("the trainer's state goes to host memory while engines generate")
        if self.release_engines:
            what.append("engines release their KV cache and weights while it trains")
        print(
            f"[trainer] colocated on {self.offload.device if self.offload else 'one device'}: "
            f"{'; '.join(what) or 'no offloading'}",
            flush=True,
        )

    async def before_train(self) -> None:
        start = time.monotonic()
        if self.release_engines:
            await self._engines("/release_memory_occupation", ALL)
        if self.offload is not None:
            await threads.compute(self.offload.to_device)
        self.seconds = time.monotonic() - start

    async def before_sync(self) -> None:
        start = time.monotonic()
        if self.release_engines:
            await self._engines("/resume_memory_occupation", ["weights"])
        self.seconds += time.monotonic() - start

    async def after_sync(self) -> None:
        start = time.monotonic()
        if self.offload is not None:
            await threads.compute(self.offload.to_host)
        if self.release_engines:
            await self._engines("/resume_memory_occupation", ["kv_cache"])
        self.seconds += time.monotonic() - start

    async def _engines(self, path: str, tags: list[str]) -> None:
        failed = await self.weight_sync.each_engine(path, {"tags": tags})
        if failed:
            raise MillstreamError(
                f"--colocate: {path} {tags} failed on "
                + "; ".join(f"{url}: {f.reason}" for url, f in failed.items())
            )
