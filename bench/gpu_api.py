"""The torch API millstream names, checked against the torch installed here, without running it.

    python bench/gpu_api.py [--strict]

The lent GPU machine runs its image's torch (2.11.0+cu130 when last read), make test runs 2.13:
a name or keyword one has and the other lacks fails only where it runs, and much of the GPU half
(CUDA graphs, IPC, the engine's release, FP8 GEMMs, NCCL) runs only on a GPU. So this reads every
file bench/gpu_imports.py scans and resolves, against this torch:

- each dotted torch name, through the file's import aliases (`torch.cuda.graph`, `F.scaled_mm`
  after `import torch.nn.functional as F`, `from torch.distributed import ProcessGroup`);
- each keyword passed to such a callable, against its signature where it has one: torch 2.11
  refused `DistributedDataParallel(..., forward_sync_buffers=False)`, 2.13's name, at every
  data-parallel start (found in the CPU rehearsal of the image, docs/gpus.md).

Not seen: methods of tensors and modules, calls through a variable, and builtins that have no
signature (most of torch's C functions): the stages are the check of those.

scripts/gpu_check.sh runs it after the import sweep and goes on whatever it finds (the stages
show what a skew breaks; the names here say where to look), and so does `make gpu-rehearsal`,
in the image's torch on the CPU. --strict: exit 1 when a name or keyword is refused.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import gpu_imports

_MISSING = object()


def _aliases(tree: ast.AST) -> dict[str, tuple[str, int]]:
    """{local name: (dotted torch name, line)} of a file's torch imports (`import torch` too)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names[a.asname or "torch"] = (a.name if a.asname else "torch", node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names if node.module.split(".")[0] == "torch" else ():
                names[a.asname or a.name] = (f"{node.module}.{a.name}", node.lineno)
    return names


def _dotted(node: ast.AST, aliases: dict[str, tuple[str, int]]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id][0], *reversed(parts)])
    return None


def uses(files: list[Path]) -> tuple[dict[str, set[str]], dict[tuple[str, str], set[str]]]:
    """({dotted torch name: where}, {(callable, keyword): where}) of `files`; where is
    "path:line"."""
    names: dict[str, set[str]] = {}
    keywords: dict[tuple[str, str], set[str]] = {}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        aliases = _aliases(tree)
        if not aliases:
            continue
        rel = (
            path.relative_to(gpu_imports.REPO_ROOT)
            if path.is_relative_to(gpu_imports.REPO_ROOT)
            else path
        )
        for name, line in aliases.values():
            names.setdefault(name, set()).add(f"{rel}:{line}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (name := _dotted(node, aliases)):
                names.setdefault(name, set()).add(f"{rel}:{node.lineno}")
            if isinstance(node, ast.Call) and (name := _dotted(node.func, aliases)):
                for kw in node.keywords:
                    if kw.arg:
                        keywords.setdefault((name, kw.arg), set()).add(f"{rel}:{node.lineno}")
    return names, keywords


def resolve(name: str) -> Any:
    """The object `name` names in this torch (the longest prefix that imports, then
    attributes), or _MISSING."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # not a module, or one that breaks here: try the shorter prefix
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                return _MISSING
        return obj
    return _MISSING


def _refuses(obj: Any, keyword: str) -> bool:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a C function without a signature: not judged
        return False
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return not takes_any and keyword not in params


def check(files: list[Path]) -> tuple[int, list[str]]:
    """(how many names and keywords were judged, one line per refused one)."""
    names, keywords = uses(files)
    refused = []
    for name in sorted(names):
        # a missing parent is the finding; its children would only repeat it
        if resolve(name) is _MISSING and resolve(name.rpartition(".")[0]) is not _MISSING:
            refused.append(f"{name}: not in torch {_version()} ({_first(names[name])})")
    judged = len(names)
    for (name, keyword), where in sorted(keywords.items()):
        obj = resolve(name)
        if obj is not _MISSING and callable(obj):
            judged += 1
            if _refuses(obj, keyword):
                refused.append(f"{name}({keyword}=...): torch {_version()} refuses the keyword "
                               f"({_first(where)})")  # fmt: skip
    return judged, refused


def _first(where: set[str]) -> str:
    ordered = sorted(where)
    return ordered[0] + (f" and {len(ordered) - 1} more" if len(ordered) > 1 else "")


def _version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strict", action="store_true", help="exit 1 when something is refused")
    args = p.parse_args(argv)
    judged, refused = check(gpu_imports.python_files())
    for line in refused:
        print(f"[gpu-api] {line}", file=sys.stderr)
    print(f"[gpu-api] torch {_version()}: {judged - len(refused)} of {judged} torch names and "
          f"keywords millstream uses are there", file=sys.stderr)  # fmt: skip
    return 1 if refused and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
