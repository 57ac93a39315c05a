"""What the GPU machine must import, and a sweep that imports it there.

    python bench/gpu_imports.py [--skip MODULE,...]

The lent GPU machine has its image's packages (scripts/gpu_image.txt) and what is carried in
`.gpu/` (scripts/gpu_wheels.txt, scripts/gpu_bundle.sh); nothing else can be installed there.
A wheel missing from the list kills every service that imports it, so every stage of
`make gpu-check` would FAIL minutes later, one window lost. scripts/gpu_check.sh therefore
runs this sweep right after installing the carried wheels: it imports every module of
millstream and every module imported anywhere in SCANNED (at any level: a function's import
runs later, on the GPU, too), and exits 2 naming a package that is missing (main says why
other import failures do not stop it).

Left out: the modules of this repository (OWN, and the files' own folders: bench/'s and
examples/arith/'s scripts import each other by name), the standard library, and OPTIONAL:
imports guarded by a flag or a try that the GPU run never takes, each with the reason.

tests/unit/deploy/test_gpu_bundle.py holds the same scan against the two package lists (fast, every
`make test`), and runs this sweep in a Python that has only the image's packages and the
carried wheels (the CPU dry run of the `.gpu` set-up, `make test-long`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("services", "bench", "tests/support", "examples")
# This repository's own top-level names: the package (services/ is `millstream`), the test
# and bench folders, and Miles' module names, which millstream's import hook serves
# (services/compat/miles/importer.py).
OWN = {"millstream", "services", "tests", "bench", "miles"}
# Imported only behind a flag or a guard that the GPU run does not take: not carried. By module
# prefix: `opentelemetry` is needed, its OTLP exporter is not.
OPTIONAL = {
    # SGLang's own server and weight format: the GPU check runs millstream's engine, and the
    # launcher uses SGLang only when it is importable (services/launch/engines.py; the
    # trainer's weights/routes/sglang_format.py is guarded by `unavailable()`); the contract
    # tier skips without it.
    "sglang": "SGLang's server and weight format, used only where sglang is importable",
    # --use-wandb only (trainer/observe/metrics.py raises a named error without it).
    "wandb": "--use-wandb only",
    # bench/bench_vs_peers.py's TRL peer, a CPU bench the GPU check does not run.
    "trl": "bench_vs_peers.py's TRL peer (a CPU bench)",
    "datasets": "bench_vs_peers.py's TRL peer (a CPU bench)",
    # `make protos` regenerates services/common/pb/ at development time; the GPU runs the
    # generated modules.
    "grpc_tools": "make protos (development time)",
    # Miles' multimodal prompts (compat/miles/processing_utils.py), for a processor that has
    # no extract_media: no text-only run reaches it.
    "qwen_vl_utils": "Miles' multimodal prompts only",
    # Spans exported over OTLP only where OTEL_EXPORTER_OTLP_ENDPOINT is set (the otlp extra;
    # common/telemetry.py): the GPU check reads its spans from Redis.
    "opentelemetry.exporter.otlp": "OTEL_EXPORTER_OTLP_ENDPOINT only (the otlp extra)",
}


def is_optional(module: str) -> bool:
    """`module` is an OPTIONAL one or inside one (the keys are dotted prefixes)."""
    return any(module == key or module.startswith(key + ".") for key in OPTIONAL)


def python_files(roots: tuple[str, ...] = SCANNED) -> list[Path]:
    return sorted(f for r in roots for f in (REPO_ROOT / r).rglob("*.py"))


def local_names(files: list[Path]) -> set[str]:
    """The names a script can import from its own folder (a sibling file or package)."""
    names = set()
    for folder in {f.parent for f in files}:
        names |= {p.stem for p in folder.glob("*.py")}
        names |= {p.parent.name for p in folder.glob("*/__init__.py")}
    return names


def imported_modules(path: Path) -> set[str]:
    """Every absolute module `path` imports, at any level: `import a.b` gives a.b,
    `from a.b import c` gives a.b (c may be a name; the module is what must import)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def third_party(files: list[Path] | None = None) -> dict[str, set[str]]:
    """{module: files importing it} for every module outside the standard library and this
    repository, optional ones included (the caller decides)."""
    files = python_files() if files is None else files
    own = OWN | local_names(files)
    found: dict[str, set[str]] = {}
    for path in files:
        for module in imported_modules(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top in own or top == "__future__":
                continue
            found.setdefault(module, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def millstream_modules() -> list[str]:
    """Every module of the package, by its import name (services/ IS millstream)."""
    names = []
    for f in sorted((REPO_ROOT / "services").rglob("*.py")):
        parts = ["millstream", *f.relative_to(REPO_ROOT / "services").with_suffix("").parts]
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def absent(err: Exception) -> str | None:
    """The distribution-level name `err` says is missing (a top-level package that does not
    import at all: a wheel to carry), else None (a module that breaks on import, or a name or
    submodule an installed package lacks: a version the stages will report on)."""
    name = getattr(err, "name", None)
    if not isinstance(err, ModuleNotFoundError) or not name:
        return None
    top = name.split(".")[0]
    try:
        importlib.import_module(top)
    except ImportError:
        return top
    return None


def sweep(skip: set[str]) -> tuple[int, dict[str, str], dict[str, str]]:
    """Import every module of millstream, then every third-party module SCANNED imports (not
    OPTIONAL, not in `skip`): how many, {module: why} of those a missing package stops, and
    {module: why} of those that break otherwise."""
    missing, broken = {}, {}
    wanted = millstream_modules() + sorted(
        m for m in third_party() if not is_optional(m) and m.split(".")[0] not in skip
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron and others warn at import: not our finding
        for module in wanted:
            try:
                importlib.import_module(module)
            except Exception as err:  # ImportError, or a module that breaks while importing
                why = f"{type(err).__name__}: {err}"
                (missing if absent(err) else broken)[module] = why
    return len(wanted), missing, broken


def main(argv: list[str] | None = None) -> int:
    """Exit 2 when a package is missing (every stage would die of it: the check stops at
    set-up); a module that breaks otherwise is named and the check goes on (its stages say
    more, and the rest of the window is not lost to it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip", default="", help="top-level modules not to import (comma list): "
                   "the CPU dry run's, of the image's packages its stand-in lacks")  # fmt: skip
    args = p.parse_args(argv)
    start = time.monotonic()
    count, missing, broken = sweep({s for s in args.skip.split(",") if s})
    seconds = time.monotonic() - start
    for module, why in {**broken, **missing}.items():
        print(f"[gpu-imports] {module}: {why}", file=sys.stderr)
    if missing:
        print(f"[gpu-imports] {len(missing)} of {count} modules miss a package: carry its "
              "wheel (scripts/gpu_wheels.txt, make gpu-bundle)", file=sys.stderr)  # fmt: skip
        return 2
    done = f"{count - len(broken)} of {count}" if broken else f"all {count}"
    print(f"[gpu-imports] {done} modules import ({seconds:.0f} s)"
          f"{'; the stages will show what the others break' if broken else ''}",
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
