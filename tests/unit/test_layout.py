"""The package layout of DESIGN.md section 2, and the light imports STYLE.md asks for."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_every_service_folder_is_a_listed_package():
    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        "millstream"
        + "".join("." + part for part in init.parent.relative_to(REPO / "services").parts)
        for init in (REPO / "services").rglob("__init__.py")
    }
    assert listed == found


SERVICES = ("router", "engine", "rollout", "reward", "trainer")


@pytest.mark.parametrize("folder", ["common", "launch", *SERVICES])
def test_services_never_import_each_other(folder):
    """Services meet on the wire. `launch` (the local cluster) is no service: it imports only
    `common`, and only the trainer's entry point starts it; `common` imports neither."""
    may_import = {"trainer": {"launch"}}.get(folder, set())
    others = ({"launch", *SERVICES} - {folder}) - may_import
    for path in (REPO / "services" / folder).rglob("*.py"):
        text = path.read_text()
        for other in others:
            assert f"millstream.{other}" not in text, f"{path} imports millstream.{other}"
            assert not re.search(rf"^\s*from \.\.+{other}\b", text, re.M), (
                f"{path} imports {other} relatively"
            )


def _imports(path: Path, package: str) -> set[str]:
    """The modules `path` (in `package`) imports, absolute and resolved from relative form."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def test_no_import_circle_among_modules():
    """A module never reaches itself through what it imports (at any depth, lazy imports in
    functions included): what two modules share goes below both."""
    modules = {}
    for path in (REPO / "services").rglob("*.py"):
        rel = path.relative_to(REPO / "services").with_suffix("")
        parts = ["millstream", *rel.parts]
        is_init = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_init else parts)
        package = name if is_init else name.rpartition(".")[0]
        modules[name] = (path, package)
    graph = {
        name: {m for m in _imports(path, package) if m in modules and m != name}
        for name, (path, package) in modules.items()
    }
    # packages import their __init__ implicitly: not an edge of ours
    graph = {n: {m for m in deps if not n.startswith(m + ".")} for n, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circle = [*trail[trail.index(dep) :], dep] if dep in trail else [node, dep]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_trainer_keeps_its_rooms():
    """The iteration and its parts at the top of trainer/, every other role in a room of its
    own (issue 29); a package's __init__ says what it owns."""
    top = sorted(p.name for p in (REPO / "services" / "trainer").glob("*.py"))
    assert len(top) <= 13, top
    for init in (REPO / "services").rglob("__init__.py"):
        if "pb" in init.parts:
            continue
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing of its room"


@pytest.mark.parametrize(
    "module",
    ["millstream.common.config", "millstream.common.types", "millstream.common.streams",
     "millstream.common.telemetry", "millstream.router", "millstream.reward", "millstream.cli"],
)  # fmt: skip
def test_light_modules_do_not_import_torch(module):
    code = f"import sys, importlib; importlib.import_module({module!r}); sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{module} imports torch: {proc.stderr}"


def test_help_imports_nothing_heavy():
    """`millstream --help` stays instant because the commands import lazily."""
    code = (
        "import sys; from millstream import cli; cli.main(['--help']); "
        "heavy = {'torch', 'transformers', 'fastapi', 'grpc', 'redis'} & set(sys.modules); "
        "sys.exit(', '.join(sorted(heavy)) or None)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"--help imported {proc.stderr}"
    assert "train-async" in proc.stdout
