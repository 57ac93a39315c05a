"""Load a user's function from `pkg.mod.fn` (or `pkg.mod:fn`), with an error naming the path.

A plugin written for Miles keeps its imports of Miles' modules: see compat/miles/importer.py
`install_miles_modules`.

Security rule: paths come only from the run config the trainer published (flags), never from
a stream entry or a gRPC request, so a message on the wire cannot make a worker import code.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from millstream.common.errors import MillstreamError


def load_object(path: str, what: str) -> Any:
    """The object at `path`; MillstreamError naming `what` (the flag) and the path otherwise."""
    module_name, sep, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise MillstreamError(f"{what} {path!r} must look like pkg.module.function")
    from .miles.importer import install_miles_modules

    stand_ins = install_miles_modules()
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None) or ""
        if stand_ins and missing.split(".")[0] == "miles":
            raise MillstreamError(
                f"{what} {path!r} imports {missing!r}, which is Miles' and not installed: {err}"
            ) from err
        raise MillstreamError(
            f"{what} {path!r}: cannot import module {module_name!r} ({err}); is it on the "
            "PYTHONPATH of every worker that runs it (rollout, reward, Celery)?"
        ) from err
    obj = getattr(module, attr, None)
    if obj is None:
        raise MillstreamError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
    return obj


def load_function(path: str, what: str) -> Callable[..., Any]:
    """The callable at `path`; MillstreamError naming `what` (the flag) and the path otherwise."""
    fn = load_object(path, what)
    if not callable(fn):
        raise MillstreamError(f"{what} {path!r} is a {type(fn).__name__}, not a function")
    return fn


@contextlib.contextmanager
def workers_sys_path() -> Iterator[None]:
    """Import as the workers do: they run as `python -m millstream.cli ...` in this directory,
    which puts it first on their sys.path; the `millstream` script does not put it on ours."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)
