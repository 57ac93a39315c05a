"""Miles' `miles.utils.iter_utils`: `group_by`, and chunking named tensors by size.

No torch import: a tensor's size is read from its `nbytes`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["chunk_named_params_by_size", "group_by"]


def group_by(iterable: Iterable[Any], key: Callable[[Any], Any] | None = None) -> dict[Any, list]:
    """Items by key, each list in the input's order; unlike itertools.groupby the input need
    not be sorted."""
    groups: defaultdict[Any, list] = defaultdict(list)
    for item in iterable:
        groups[key(item) if key is not None else item].append(item)
    return dict(groups)


def chunk_named_params_by_size(
    named_params: Iterable[tuple[str, Any]], chunk_size: int
) -> Iterator[list[tuple[str, Any]]]:
    """(name, tensor) pairs in buckets that stay under chunk_size bytes (a tensor larger than
    that gets a bucket of its own)."""
    return _chunk_by_size(named_params, lambda pair: pair[1].nbytes, chunk_size)


def _chunk_by_size(
    objects: Iterable[Any], compute_size: Callable[[Any], int], chunk_size: int
) -> Iterator[list[Any]]:
    bucket: list[Any] = []
    size = 0
    for obj in objects:
        obj_size = compute_size(obj)
        if bucket and size + obj_size >= chunk_size:
            yield bucket
            bucket, size = [], 0
        bucket.append(obj)
        size += obj_size
    if bucket:
        yield bucket
