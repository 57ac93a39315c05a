"""Miles' module names for millstream's stand-ins: an import hook, installed on demand.

`install_miles_modules()` (called by every plugin loader, compat/plugins.py) puts one finder
first on `sys.meta_path` unless the real Miles is importable (then its imports are its own).
The finder answers every name under `miles`, lazily, when it is imported:

* a name in MILES_MODULES (or under `miles.rollout.rm_hub.`) is the same module object as
  ours: `sys.modules["miles.utils.types"] is millstream.compat.miles.types`;
* a package on the way to one (`miles`, `miles.utils`, `miles.rollout`, ...) is an empty
  package; `from miles.utils import misc` works too. `miles.backends` is one only on the way
  to `training_utils.cp_utils`, which CP-aware loss and TIS functions import (cp_utils.py);
  the rest of it stays refused;
* any other name raises ModuleNotFoundError naming it and saying why: REFUSED's reason for
  the parts of Miles that run its Ray cluster, Megatron and launch tooling, else the list of
  what millstream stands in for.

Installing imports nothing (no torch, no transformers); each stand-in loads its own
dependencies when first used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

__all__ = ["MILES_MODULES", "PACKAGES", "REFUSED", "install_miles_modules", "why_missing"]

_OURS = "millstream.compat.miles"

# Miles' module -> the module of ours it is.
MILES_MODULES: dict[str, str] = {
    "miles.utils.types": f"{_OURS}.types",
    "miles.utils.http_utils": f"{_OURS}.http_utils",
    "miles.utils.misc": f"{_OURS}.misc",
    "miles.utils.async_utils": f"{_OURS}.async_utils",
    "miles.utils.data": f"{_OURS}.data",
    "miles.utils.iter_utils": f"{_OURS}.iter_utils",
    "miles.utils.processing_utils": f"{_OURS}.processing_utils",
    "miles.utils.mask_utils": f"{_OURS}.mask_utils",
    "miles.utils.metric_utils": f"{_OURS}.metric_utils",
    "miles.utils.tracking_utils": f"{_OURS}.tracking",
    "miles.utils.tracking_utils.tracking": f"{_OURS}.tracking",
    "miles.rollout.base_types": f"{_OURS}.base_types",
    "miles.rollout.data_source": f"{_OURS}.data_source",
    "miles.rollout.filter_hub.base_types": f"{_OURS}.filter_hub",
    "miles.rollout.filter_hub.dynamic_sampling_filters": f"{_OURS}.filter_hub",
    "miles.rollout.sglang_rollout": f"{_OURS}.sglang_rollout",
    "miles.rollout.rm_hub": f"{_OURS}.rm_hub",
    "miles.backends.training_utils.cp_utils": f"{_OURS}.cp_utils",
}
_PREFIXES = {"miles.rollout.rm_hub.": f"{_OURS}.rm_hub."}  # submodules one to one

PACKAGES = frozenset(
    ".".join(name.split(".")[:i])
    for name in [*MILES_MODULES, *_PREFIXES]
    for i in range(1, name.rstrip(".").count(".") + 1)
)

_RAY = (
    "Miles' Ray actors and placement; millstream's services are processes that meet on Redis "
    "streams, gRPC and HTTP, with no Ray"
)
_MEGATRON = (
    "Miles' training backends' internals (Megatron, FSDP); millstream's trainer has its own "
    "backends (--train-backend)"
)
_BACKENDS = (
    f"{_MEGATRON}. Of it, millstream stands in for miles.backends.training_utils.cp_utils "
    "only (the context parallel gather and slice of a loss or TIS function)"
)
_LAUNCH = (
    "Miles' launch tooling (downloads, checkpoint conversion, execute_train); launch with the "
    "`millstream` command (examples/miles_compat/)"
)
_LORA = "LoRA, which millstream does not build: it trains every parameter"
_ARGS = (
    "Miles' flag parser; millstream parses Miles' flags itself and hands plugins the read-only "
    "`args`"
)
_BATCH = (
    "Miles' whole-batch rollout drivers; here the trainer admits groups and each rollout "
    "worker serves one: write a per-sample --custom-generate-function-path or the per-group "
    "--rollout-function-path"
)
_EVAL = "Miles' eval datasets and checkpoint eval; millstream evaluates with the --eval-* flags"
_DEBUG = "Miles' debugging and audit tools for its engines and trainer"
_SESSION = "Miles' agent session server, which millstream does not build"
_TRACKING = (
    "Miles' wandb helpers; millstream logs itself (--use-wandb, --use-tensorboard), and a log "
    "function's tracking.log (miles.utils.tracking_utils) lands in the trainer's row"
)

# Miles' module (or package: everything under it) -> why millstream has no stand-in for it.
REFUSED: dict[str, str] = {
    "miles.ray": _RAY,
    "miles.utils.ray_utils": _RAY,
    "miles.utils.ft_utils": _RAY,
    "miles.utils.object_store": _RAY,
    "miles.backends": _BACKENDS,
    "miles.utils.megatron_bridge_utils": _MEGATRON,
    "miles.utils.reloadable_process_group": _MEGATRON,
    "miles.utils.replay_base": _MEGATRON,
    "miles.utils.distributed_utils": _MEGATRON,
    "miles.utils.external_utils": _LAUNCH,
    "miles.utils.lora": _LORA,
    "miles.utils.multi_lora": _LORA,
    "miles.utils.adapter_config": _LORA,
    "miles.rollout.multi_lora": _LORA,
    "miles.utils.arguments": _ARGS,
    "miles.utils.argparse_utils": _ARGS,
    "miles.utils.megatron_args_utils": _ARGS,
    "miles.rollout.inference_rollout": _BATCH,
    "miles.rollout.generate_hub": _BATCH,
    "miles.rollout.generate_utils": _BATCH,
    "miles.rollout.fully_async_rollout": _BATCH,
    "miles.rollout.fully_async_data_buffer": _BATCH,
    "miles.rollout.sft_rollout": _BATCH,
    "miles.rollout.sleep_rollout": _BATCH,
    "miles.rollout.submission_scheduler": _BATCH,
    "miles.rollout.checkpoint_eval": _EVAL,
    "miles.utils.eval_config": _EVAL,
    "miles.utils.dumper_utils": _DEBUG,
    "miles.utils.debug_utils": _DEBUG,
    "miles.utils.audit_utils": _DEBUG,
    "miles.rollout.session": _SESSION,
    "miles.utils.wandb_utils": _TRACKING,
    "miles.router": "Miles' router; millstream has its own (router/), which speaks SGLang's API",
}


def _ours(name: str) -> str | None:
    if name in MILES_MODULES:
        return MILES_MODULES[name]
    for prefix, target in _PREFIXES.items():
        if name.startswith(prefix):
            return target + name[len(prefix) :]
    return None


def why_missing(name: str) -> str:
    """The message of the ModuleNotFoundError for Miles' module `name`."""
    for prefix, reason in REFUSED.items():
        if name == prefix or name.startswith(prefix + "."):
            return f"No module named {name!r} in millstream: it is {reason}"
    return (
        f"No module named {name!r} in millstream (Miles is not installed): millstream stands "
        f"in for these Miles modules: {', '.join(sorted(MILES_MODULES))}, and "
        "miles.rollout.rm_hub.*; import the rest from Miles, or write it in your module"
    )


class _Alias(importlib.abc.Loader):
    """Loads a Miles name as an existing module of ours. The import system sets the module's
    `__spec__` to the alias's; it gets its own back, or its relative imports would resolve
    against Miles' name."""

    def __init__(self, module: types.ModuleType):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec


class _EmptyPackage(importlib.abc.Loader):
    """A package of Miles' on the way to a stand-in; its other submodules are explained."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = f"millstream's stand-in for Miles' package {module.__name__}"
        module.__millstream__ = True  # type: ignore[attr-defined]

        def submodule(attr: str) -> Any:
            if attr.startswith("_") or not attr.isidentifier():
                raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")
            return importlib.import_module(f"{module.__name__}.{attr}")

        module.__getattr__ = submodule  # type: ignore[attr-defined]


class MilesFinder(importlib.abc.MetaPathFinder):
    """Finds every `miles` name (see the module docstring)."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "miles" and not fullname.startswith("miles."):
            return None
        ours = _ours(fullname)
        if ours is not None:
            module = importlib.import_module(ours)
            return importlib.util.spec_from_loader(
                fullname, _Alias(module), is_package=hasattr(module, "__path__")
            )
        if fullname in PACKAGES:
            return importlib.util.spec_from_loader(fullname, _EmptyPackage(), is_package=True)
        raise ModuleNotFoundError(why_missing(fullname), name=fullname)


def _installed() -> bool:
    return any(isinstance(finder, MilesFinder) for finder in sys.meta_path)


def install_miles_modules() -> bool:
    """Put the finder first on sys.meta_path unless Miles itself is importable; True when
    `import miles.utils.types` now gives millstream's stand-in. Idempotent."""
    if _installed():
        return True
    present = sys.modules.get("miles")
    if present is not None:
        return bool(getattr(present, "__millstream__", False))
    if importlib.util.find_spec("miles") is not None:
        return False  # the real Miles: its imports are its own
    sys.meta_path.insert(0, MilesFinder())
    return True
