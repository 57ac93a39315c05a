"""Declare a flag once; get an argparse option and a typed, frozen config field from it.

Each argument group is a frozen dataclass whose fields use `flag(...)`. The flag name is the
field name with dashes (`rollout_batch_size` -> `--rollout-batch-size`), exactly as Miles
spells it, so a Miles launch script's bash arrays parse unchanged. Types come from the
annotations: `int`, `float`, `str`, `bool` (store_true), `bool | None` (`--x` / `--no-x`, None
when neither is given, as Miles' BooleanOptionalAction flags), `X | None`, `list[str]`,
`list[int]`, and `dict[str, Any]` (a JSON object on the command line, as Miles' `type=json.loads`
flags). `option` names a flag whose spelling is not its field's: a `bool` field that defaults
to True is then Miles' `store_false` flag (`--disable-rollout-global-dataset` clears
`rollout_global_dataset`).

Nothing here imports torch: router and reward workers load config without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
    option: str | None = None,
    miles: bool = True,
) -> Any:
    """A dataclass field that is also a command-line flag (`aliases`: other spellings, e.g.
    Miles' name where the issue or SGLang uses another; `option`: the flag's spelling when it
    is not the field's, see the module docstring; `miles=False`: not a flag of Miles, so a
    --custom-config-path key of its name is a plugin's: custom.py)."""
    metadata = {
        "help": help, "choices": choices, "aliases": aliases, "option": option, "miles": miles
    }  # fmt: skip
    return _field(default, metadata)


def _field(default: Any, metadata: dict[str, Any]) -> Any:
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def json_object(text: str) -> dict[str, Any]:
    """A JSON object flag's value (argparse reports the ValueError as an invalid value)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text}")
    return value


json_object.__name__ = "JSON object"  # argparse names the type in its error


def derived(default: Any = None, help: str = "") -> Any:
    """A config field that is not a flag of its own: filled from the command line by
    `parse_run_config` (e.g. the --sglang-* server flags handed on to SGLang)."""
    return _field(default, {"help": help, "derived": True})


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
        option = f.metadata.get("option") or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help") or None}
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        if tp is bool and f.default is True:
            kwargs["action"] = "store_false"
        elif tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if optional else "store_true"
        elif typing.get_origin(tp) is dict:
            kwargs["type"] = json_object
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


def coerce(cls: type, name: str, value: Any) -> Any:
    """`value`, read from a YAML or JSON file, as field `name` of `cls` holds it; ValueError
    saying what was expected when it cannot be (a number for a str flag, an unknown choice)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    tp, optional = _unwrap(typing.get_type_hints(cls)[name])
    if value is None:
        if optional:
            return None
        raise ValueError("must not be null")
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {value!r}")
        return [_scalar(typing.get_args(tp)[0], v) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping, got {value!r}")
        return dict(value)
    value = _scalar(tp, value)
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
    return value


def _scalar(tp: Any, value: Any) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if tp is float and number:
        return float(value)
    if tp is int and number and float(value).is_integer():
        return int(value)
    if tp is str and isinstance(value, str):
        return value
    raise ValueError(f"expected {getattr(tp, '__name__', tp)}, got {value!r}")
