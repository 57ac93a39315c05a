"""The disk route: each bucket a safetensors file under `directory`/v{version}/ (written to a
`.partial` directory, renamed when whole), then `/update_weights_from_disk` on every engine;
older versions' files are removed. Slow, and works wherever a file system is shared
(--update-weight-disk-dir, default RUN_DIR/weight_updates)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from millstream.common import threads
from millstream.common.errors import MillstreamError
from millstream.common.weight_routes import DISK

from ..calls import Calls
from .base import Bucket, Push, Sender


class DiskSender(Sender):
    """The disk route to the engines on it (module docstring); `directory`: where the files go
    (None: no engine may take this route)."""

    name = DISK

    def __init__(self, directory: Path | None):
        self.directory = directory

    async def send(self, push: Push, engines: list[str], buckets: Sequence[Bucket]) -> list[str]:
        if not engines:
            return []
        report = push.report
        if self.directory is None:
            raise MillstreamError(
                f"weight sync v{report.version}: {engines} take weights from disk, and no "
                "--update-weight-disk-dir is set"
            )
        start = time.monotonic()
        failed = await push_disk(
            push.calls, engines, buckets, report.version, self.directory, report.flush_cache
        )
        report.add_time("disk", time.monotonic() - start)
        return await push.remove(engines, failed)


async def push_disk(
    calls: Calls,
    engines: list[str],
    buckets: Sequence[Bucket],
    version: int,
    directory: Path,
    flush: bool = True,
) -> dict[str, object]:
    """The weights as safetensors files in `directory`/v{version}/, one per bucket, then
    `/update_weights_from_disk` on every engine; older versions' files are removed."""
    target = directory / f"v{version}"
    await threads.compute(_write_buckets, buckets, target)
    failed = await calls.each(
        engines,
        "/update_weights_from_disk",
        lambda _i, _u: {
            "model_path": str(target),
            "weight_version": str(version),
            "flush_cache": flush,
        },
    )
    for old in directory.glob("v*"):
        if old != target and old.name[1:].isdigit() and int(old.name[1:]) < version:
            await asyncio.to_thread(shutil.rmtree, old, True)
    return dict(failed)


def _write_buckets(buckets: Sequence[Bucket], target: Path) -> None:
    from safetensors.torch import save_file

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for k, bucket in enumerate(buckets):
        tensors = {
            n: t.detach().to("cpu").contiguous()
            for n, t in zip(bucket.names, bucket.tensors, strict=True)
        }
        save_file(tensors, str(partial / f"weights-{k:05d}.safetensors"))
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
