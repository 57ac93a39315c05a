"""--colocate: the trainer and the engines take turns on one GPU (docs/gpus.md).

One iteration, in Miles' order (--offload-rollout: the engines' turns; --offload-train: the
trainer's):

    engines generate the batch            the trainer's state is in host memory
    1. release   every engine: /release_memory_occupation {kv_cache, weights}
                 (running requests are retracted and wait, new ones queue)
    2. onload    the trainer's parameters, optimizer state, --bf16 masters to the GPU
    3. train     the optimizer steps
    4. resume    every engine: /resume_memory_occupation {weights}
    5. sync      the weight sync (CUDA IPC on one GPU: no copy leaves the device)
    6. offload   the trainer's state to host memory (its gradients dropped: offload.py)
    7. resume    every engine: /resume_memory_occupation {kv_cache}; generation goes on

The invariant: the GPU never holds the trainer's state and an engine's KV cache at once. So
the peak is the trainer's step, or the engine's generation, plus the other's weights during
the sync; and at the end of every iteration the trainer's state is back in host memory and
every engine whole. It holds only with both offloads on (the default with --colocate): with
--no-offload-train or --no-offload-rollout the user chose to share the GPU, and the turns are
recorded without it.

Each turn is recorded (`turns`, this iteration's; `Turn`): its name, the trainer's residency
and bytes on its device as TrainOffload's books report them, and the engines' memory tags
released as the engines acknowledged them (a release or resume every engine answered with
success; one that fails stops the run, so the tags are those of every engine). The
invariant is checked after each turn and at the end of the iteration, and a violation is an
error (`ColocationError`), not a record: only a wrong order here can cause one, and on a GPU
it means either an out-of-memory failure in the next turn or an engine generating beside a
trainer it was sized without. On the CPU nothing moves, but the books move all the same, so
a reordering fails `make test` (tests/unit/trainer/test_colocate_turns.py) as it would fail on a GPU;
the GPU tests measure the same turns with `torch.cuda.memory_allocated`.

An engine that fails a release or a resume is reported by name and the run stops: an engine
left half released would hold requests forever.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from millstream.common import threads
from millstream.common.errors import MillstreamError

log = logging.getLogger(__name__)

ALL = ["kv_cache", "weights"]


class ColocationError(MillstreamError):
    """A turn left the trainer's state and an engine's KV cache on the GPU together, or an
    iteration ended with either out of place (module docstring)."""


@dataclass(frozen=True)
class Turn:
    """The state after one turn: the trainer's (`trainer_bytes` None: not offloaded,
    --no-offload-train), the engines' (`released`: the memory tags every engine released)."""

    name: str
    trainer_resident: bool
    trainer_bytes: int | None
    released: frozenset[str]
    seconds: float

    def __str__(self) -> str:
        where = "on the device" if self.trainer_resident else "in host memory"
        size = "" if self.trainer_bytes is None else f" ({self.trainer_bytes / 2**20:.1f} MiB)"
        return (
            f"{self.name}: the trainer's state {where}{size}, "
            f"engines released {sorted(self.released) or 'nothing'}"
        )


class Colocation:
    """The turns of one iteration (module docstring); `offload` None: --no-offload-train,
    `release_engines` False: --no-offload-rollout."""

    def __init__(self, weight_sync: Any, offload: Any | None, release_engines: bool):
        self.weight_sync = weight_sync
        self.offload = offload
        self.release_engines = release_engines
        self.seconds = 0.0  # this iteration's time in turns (releases, resumes, moves)
        self.turns: list[Turn] = []  # this iteration's (start(): the one before the first)
        self.released: set[str] = set()  # the engines' memory tags released now
        # The invariant is the design's only with both offloads (module docstring).
        self.checked = offload is not None and release_engines

    async def start(self) -> None:
        """Before the first rollout: the engines get the GPU."""
        self.turns = []
        if self.offload is not None:
            await self._trainer("offload", self.offload.to_host)
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
        self.turns, self.seconds = [], 0.0
        if self.release_engines:
            await self._engines("release", "/release_memory_occupation", ALL)
        if self.offload is not None:
            await self._trainer("onload", self.offload.to_device)

    async def before_sync(self) -> None:
        if self.release_engines:
            await self._engines("resume weights", "/resume_memory_occupation", ["weights"])

    def sync_source(self, named_weights: Callable[[], Any]) -> Callable[[], Any]:
        """`named_weights` as the weight sync reads it, checked at the read: between
        `before_sync` and `after_sync` the trainer's state is on its device and every engine's
        weights are back. A sync that ran after the offload would read the trainer's weights
        from host memory (on a GPU: tensors a CUDA IPC handle cannot share), one before the
        engines' resume would write into released weights; on the CPU nothing moves, so the
        books are what shows it (Trainer._train_and_sync's order, tested as the trainer runs
        it in tests/unit/trainer/test_colocate_turns.py)."""

        def read() -> Any:
            if self.offload is not None and not self.offload.resident:
                raise ColocationError(
                    "--colocate: the weight sync read the trainer's weights while its state "
                    f"is in host memory (turns so far: {[t.name for t in self.turns]}); the "
                    "sync runs between before_sync and after_sync"
                )
            if "weights" in self.released:
                raise ColocationError(
                    "--colocate: the weight sync ran while the engines' weights are released "
                    f"(turns so far: {[t.name for t in self.turns]}); before_sync resumes them"
                )
            return named_weights()

        return read

    async def after_sync(self) -> None:
        if self.offload is not None:
            await self._trainer("offload", self.offload.to_host)
        if self.release_engines:
            await self._engines("resume kv_cache", "/resume_memory_occupation", ["kv_cache"])
        self._check_end()

    async def _trainer(self, name: str, move: Callable[[], Any]) -> None:
        start = time.monotonic()
        await threads.compute(move)
        self._record(name, time.monotonic() - start)

    async def _engines(self, name: str, path: str, tags: list[str]) -> None:
        start = time.monotonic()
        failed = await self.weight_sync.each_engine(path, {"tags": tags})
        if failed:
            raise MillstreamError(
                f"--colocate: {path} {tags} failed on "
                + "; ".join(f"{url}: {f.reason}" for url, f in failed.items())
            )
        if path == "/release_memory_occupation":
            self.released |= set(tags)
        else:
            self.released -= set(tags)
        self._record(name, time.monotonic() - start)

    def _record(self, name: str, seconds: float) -> None:
        self.seconds += seconds
        o = self.offload
        turn = Turn(
            name,
            trainer_resident=o is None or o.resident,
            trainer_bytes=None if o is None else o.resident_bytes(),
            released=frozenset(self.released),
            seconds=seconds,
        )
        self.turns.append(turn)
        log.info("colocate turn %s (%.3f s)", turn, seconds)
        if self.checked and turn.trainer_resident and "kv_cache" not in turn.released:
            raise ColocationError(
                f"--colocate: after the turn '{turn}', the trainer's state and the engines' "
                f"KV cache are both on the device (turns so far: {[t.name for t in self.turns]})"
            )

    def _check_end(self) -> None:
        """After the sync: the trainer's state in host memory, every engine whole again."""
        end = self.turns[-1] if self.turns else None
        if self.offload is not None and self.offload.resident:
            raise ColocationError(
                f"--colocate: the iteration ended with the trainer's state on the device "
                f"(last turn: {end}); it goes to host memory after the sync"
            )
        if self.released:
            raise ColocationError(
                f"--colocate: the iteration ended with the engines' {sorted(self.released)} "
                f"released (last turn: {end})"
            )
