"""Declare a flag once; get an argparse option and a typed, frozen config field from it.

Each argument group is a frozen dataclass whose fields use `flag(...)`. The flag name is the
field name with dashes (`rollout_batch_size` -> `--rollout-batch-size`), exactly as Miles
spells it, so a Miles launch script's bash arrays parse unchanged. Types come from the
annotations: `int`, `float`, `str`, `bool` (store_true), `bool | None` (`--x` / `--no-x`, None
when neither is given, as Miles' BooleanOptionalAction flags), `X | None`, `list[str]`,
`list[int]`.

Nothing here imports torch: router and reward workers load config without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def flag(
    default: Any = None,
    help: str = "",
    *,
    choices: tuple[str, ...] | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field that is also a command-line flag (`aliases`: other spellings, e.g.
    Miles' name where the issue or SGLang uses another)."""
    metadata = {"help": help, "choices": choices, "aliases": aliases}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def derived(default: Any = None, help: str = "") -> Any:
    """A config field that is not a flag of its own: filled from the command line by
    `parse_run_config` (e.g. the --sglang-* server flags handed on to SGLang)."""
    metadata = {"help": help, "derived": True}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for `X | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported flag type {tp}")
        return args[0], True
    return tp, False


def add_group(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):
            continue
        tp, optional = _unwrap(typing.get_type_hints(cls)[f.name])
        option = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help") or None}
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if optional else "store_true"
        elif typing.get_origin(tp) is list:
            kwargs["nargs"] = "+"
            kwargs["type"] = typing.get_args(tp)[0]
        else:
            kwargs["type"] = tp
        aliases = f.metadata.get("aliases", ())
        group.add_argument(option, *aliases, default=argparse.SUPPRESS, **kwargs)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """Build the group from parsed flags; flags not given keep the field default."""
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    return cls(**given)


def given_flags(cls: type, ns: argparse.Namespace) -> set[str]:
    """Names of this group's fields the user actually passed (defaults are SUPPRESSed)."""
    return {f.name for f in dataclasses.fields(cls) if hasattr(ns, f.name)}


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Inverse of `to_dict`, recursing into nested config dataclasses; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown config keys {sorted(unknown)}")
    kwargs = {}
    for name, value in data.items():
        tp, _ = _unwrap(hints[name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = from_dict(tp, value)
        kwargs[name] = value
    return cls(**kwargs)
