"""SGLang's own package as the judge of what millstream hands an SGLang server.

SGLang is installed without its GPU dependencies into `.venv/sglang` (scripts/bootstrap.sh,
scripts/sglang-contract.txt), a folder only its users put on their path: an importable
`sglang` makes millstream's launcher start SGLang servers. Two users:

  the contract tier   tests/contract/conftest.py calls `load()` once, in its own pytest
                      (MILLSTREAM_CONTRACT=1, PYTHONPATH=.venv/sglang);
  the SGLang stand-in tests/support/sglang_standin, in the main run, where `sglang` must stay
                      unimportable: it runs this module in a child process,
                      `python -m tests.support.sglang_contract ARGV...` with only
                      .venv/sglang and this repository on PYTHONPATH.

The child does what `python -m sglang.launch_server ARGV` does before it serves:
`prepare_server_args` (argparse: exit 2 naming an unknown or ambiguous flag) and
`resolve_once` (the model's config, the device, the limits: an exception that names what it
refuses); then it prints one JSON line, `[[flag, value], ...]`: `--model-path`, `--host`,
`--port`, and every other server setting whose value is not SGLang's default, each under
SGLang's first spelling of its flag, the value as parsed (before resolution fills defaults in).

One stand-in, made before SGLang is imported: `torchvision`. SGLang's config package imports
two multimodal preprocessing modules that import it at module level
(`sglang.srt.multimodal.internvl_utils`, `sglang.srt.configs.deepseek_ocr`); PyPI's
torchvision is a CUDA build that cannot load beside the CPU torch ("operator torchvision::nms
does not exist"). The stand-in is a module object in `sys.modules` only (not a package on the
path, so transformers, which asked first, still knows torchvision is absent), with their
`InterpolationMode` and every other name a function that raises when called: nothing in the
request classes, the server arguments, their resolution or the weight-sync classes calls them.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib
import importlib.util
import json
import sys
import types
import warnings
from collections.abc import Iterator

# What a server must be told whatever SGLang's defaults are: the child always reports them.
ALWAYS = ("--model-path", "--host", "--port")


def stand_in_torchvision() -> None:
    """Put the torchvision stand-in (module docstring) in `sys.modules`, unless a real one is
    importable or already imported."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()  # asked once, cached: stays absent

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    def module(name: str) -> types.ModuleType:
        m = types.ModuleType(name, "a stand-in (tests/support/sglang_contract.py): not torchvision")
        m.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]

        def __getattr__(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def unavailable(*args: object, **kwargs: object) -> None:
                raise RuntimeError(f"{name}.{attr}: torchvision is stood in for here")

            return unavailable

        m.__getattr__ = __getattr__  # type: ignore[method-assign]
        sys.modules[name] = m
        return m

    tv = module("torchvision")
    tv.transforms = module("torchvision.transforms")  # type: ignore[attr-defined]
    tv.transforms.functional = module("torchvision.transforms.functional")  # type: ignore[attr-defined]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """SGLang's own import-time warnings (torch deprecations in its kernels' modules, "only
    CUDA supports ..." from its quantization modules) left out: they are not ours, and the
    tests run with -W error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def load(*modules: str) -> None:
    """Import SGLang's `modules` (its server arguments when none are named) with the stand-in
    and the warnings this module's docstring describes."""
    stand_in_torchvision()
    with quiet():
        for name in modules or ("sglang.srt.server_args",):
            importlib.import_module(name)


def server_settings(server_args: object) -> list[list[object]]:
    """`ALWAYS` and every setting of `server_args` that is not SGLang's default, as
    [SGLang's first spelling of its flag, value]."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    out: list[list[object]] = []
    seen: set[str] = set()
    for action in parser._actions:
        dest, flag = action.dest, (action.option_strings or [""])[0]
        skip = dest in ("help", "config") or action.default is argparse.SUPPRESS
        if not flag or skip or dest in seen:
            continue
        seen.add(dest)
        value = getattr(server_args, dest, action.default)
        if flag in ALWAYS or value != action.default:
            out.append([flag, value])
    return out


def main(argv: list[str]) -> None:
    load("sglang.srt.server_args")
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)  # an unknown flag: argparse says so, exits 2
    settings = server_settings(server_args)
    with quiet():  # resolution imports more of SGLang (its model and quantization modules)
        server_args.resolve_once()
    print(json.dumps(settings, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
