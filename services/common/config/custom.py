"""Miles' --custom-config-path: a YAML file of settings for the run and its plugins.

Miles reads the file once, after its flags, and sets each key on `args`, over what the command
line gave (miles/utils/arguments.py). Its examples use it for a plugin's own settings, which are
no flags: train_infer_mismatch_helper/mis.yaml gives the TIS/RS function its tis_level, use_rs,
tis_upper_bound, ... Here, read once in `parse_run_config`:

- a key that names a flag sets the flag (typed and checked like a command line value, then the
  config validates it as any other), as Miles' setattr does;
- any other key, and one naming a flag millstream adds and Miles does not have (`miles=False`
  in its schema: --tis-mode, whose name mis.yaml uses for its own setting), goes to
  `cfg.rollout.custom_config`, which plugins see as `args.<key>` (compat/miles make_args).

The value `base64:<payload>` is the YAML itself, base64-encoded, as Miles takes it. PyYAML is
imported only when the flag is given.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import json
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .schema import coerce

FLAG = "--custom-config-path"


def read(path: str) -> dict[str, Any]:
    """The file's (or base64 payload's) mapping; ConfigError naming the flag otherwise."""
    try:
        import yaml
    except ImportError:
        raise ConfigError(f"{FLAG} needs PyYAML: pip install pyyaml") from None
    try:
        if path.startswith("base64:"):
            text = base64.b64decode(path.removeprefix("base64:"), validate=True).decode()
        else:
            text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, binascii.Error, yaml.YAMLError) as err:
        raise ConfigError(f"{FLAG} {path}: cannot read it ({err})") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"{FLAG} {path}: expected a mapping of names to values")
    return data


def apply(ns: argparse.Namespace, groups: tuple[tuple[str, type, str], ...]) -> None:
    """Set the file's flags on `ns` and put the rest in `ns.custom_config` (module docstring)."""
    path = getattr(ns, "custom_config_path", None)
    if not path:
        return
    flags = {
        f.name: cls
        for _, cls, _ in groups
        for f in dataclasses.fields(cls)
        if not f.metadata.get("derived") and f.metadata.get("miles", True)
    }
    extras: dict[str, Any] = {}
    for key, value in read(path).items():
        if key in flags:
            try:
                setattr(ns, key, coerce(flags[key], key, value))
            except ValueError as err:
                raise ConfigError(f"{FLAG} {path}: {key}: {err}") from None
        else:
            extras[key] = value
    try:
        json.dumps(extras)  # the config travels to the workers as JSON
    except TypeError as err:
        raise ConfigError(f"{FLAG} {path}: a value is not plain data ({err})") from None
    ns.custom_config = extras
