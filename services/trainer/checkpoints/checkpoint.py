"""Checkpoints Miles users can resume: `{save}/iter_{N:07d}/` plus `latest_checkpointed_iteration.txt`.

    iter_0000012/model/            the actor in Hugging Face format (engines load it directly)
    iter_0000012/optimizer.pt      optimizer + LR scheduler state (loaded with weights_only=True)
    iter_0000012/trainer_state.json  iteration, policy version, data position, terminal counts,
                                   groups still in flight, RNG state

A checkpoint is written to a temp dir of its writer's own and renamed into place (an iter_N/
already there is moved aside first and removed after); the `latest` file is written last,
atomically: atomic.py. So a kill at any point, SIGKILL included, leaves the previous
checkpoint as the latest, whole, and loading reads only the iter_N/ the `latest` file names.
What a killed save leaves is put back or removed at the next start (atomic.recover).
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from millstream.common.errors import MillstreamError

from . import atomic

LATEST = "latest_checkpointed_iteration.txt"
STATE = "trainer_state.json"


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str | Path | None) -> int | None:
    if not root:
        return None
    path = Path(root) / LATEST
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise MillstreamError(f"{path} holds {text!r}, not an iteration number")
    if not iter_dir(root, int(text)).is_dir():
        raise MillstreamError(
            f"{path} points at iteration {text} but {iter_dir(root, int(text))} is missing"
        )
    return int(text)


def rng_state() -> dict[str, Any]:
    import torch  # here: reading a checkpoint's position (main.py's summary) needs no torch

    version, state, gauss = random.getstate()
    return {
        "python": [version, list(state), gauss],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def save(
    root: str | Path,
    iteration: int,
    backend: Any,
    state: dict[str, Any],
    save_optimizer: bool,
    *,
    before_commit: Callable[[], None] | None = None,
) -> Path:
    """Write iteration `iteration` and make it the latest. Returns its directory.

    `before_commit` is called once every file is written, right before the rename into place:
    what it raises (the trainer no longer holds the run) propagates, with the temp dir removed
    and nothing renamed or made the latest."""

    def fill(tmp: Path) -> None:
        backend.save(tmp, save_optimizer=save_optimizer)
        (tmp / STATE).write_text(json.dumps({**state, "iteration": iteration, "rng": rng_state()}))

    final = atomic.write_dir(iter_dir(root, iteration), fill, before_commit)
    atomic.write_text(Path(root) / LATEST, str(iteration))
    return final


def load_state(root: str | Path, iteration: int) -> dict[str, Any]:
    return json.loads((iter_dir(root, iteration) / STATE).read_text())
