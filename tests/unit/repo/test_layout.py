"""The package layout (docs/architecture.md), and light imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


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
# No service's: the local cluster (`launch`), Miles' stand-ins and the plugin loader (`compat`),
# the command-line tools over a run's files and the protos (`tools`). Each imports only `common`.
NOT_SERVICES = ("launch", "compat", "tools")
# Who may import one of them: the services that run users' plugins `compat`, and the trainer's
# entry point `launch` (main.py starts the cluster; preflight.py, which main.py runs before
# anything starts, asks launch's plan what it would start). Nothing imports `tools`.
MAY_IMPORT = {"trainer": {"launch", "compat"}, "rollout": {"compat"}, "reward": {"compat"}}
ENTRY_POINT = ("trainer/main.py", "trainer/preflight.py")


@pytest.mark.parametrize("folder", ["common", *NOT_SERVICES, *SERVICES])
def test_services_never_import_each_other(folder):
    """Services meet on the wire. `common` imports none of the others; `launch`, `compat` and
    `tools` only `common`; the trainer, rollout and reward workers `compat`, and only the
    trainer's entry point `launch` (MAY_IMPORT)."""
    may_import = MAY_IMPORT.get(folder, set())
    for path in (REPO / "services" / folder).rglob("*.py"):
        text = path.read_text()
        rel = str(path.relative_to(REPO / "services"))
        allowed = may_import - ({"launch"} if rel not in ENTRY_POINT else set())
        others = ({*NOT_SERVICES, *SERVICES} - {folder}) - allowed
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


ENGINE = REPO / "services" / "engine"


def _engine_layer(parts: list[str], folders: set[str]) -> str:
    """The layer of an engine module, from its path under engine/ (or its dotted name under
    millstream.engine): its folder's, main.py's own, else the top level's, `scheduling`."""
    if parts[0] in folders:
        return parts[0]
    return "main" if parts[0] == "main" else "scheduling"


def test_the_engine_keeps_its_layers():
    """engine/__init__.py states the layers, lowest first; each of its modules imports its own
    layer and those below, never one above (lazy imports in functions included). Every folder
    of engine/ is a layer of that table, and its __init__ names each of its files."""
    doc = ast.get_docstring(ast.parse((ENGINE / "__init__.py").read_text())) or ""
    order = re.search(r"Layers, lowest first: ([\w <]+)\.", doc)
    assert order, "engine/__init__.py states no layer order"
    layers = [name.strip() for name in order.group(1).split("<")]
    rank = {name: i for i, name in enumerate(layers)}
    folders = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").is_file()}
    assert folders | {"scheduling", "main"} == set(layers), layers
    for folder in sorted(folders):
        assert f"`{folder}/`" in doc, f"engine/__init__.py's table has no row for {folder}/"
        room = ast.get_docstring(ast.parse((ENGINE / folder / "__init__.py").read_text())) or ""
        for path in sorted((ENGINE / folder).glob("*.py")):
            assert path.name == "__init__.py" or f"`{path.name}`" in room, (
                f"engine/{folder}/__init__.py does not name {path.name}"
            )
    upward = []
    for path in sorted(ENGINE.rglob("*.py")):
        rel = path.relative_to(ENGINE)
        own = _engine_layer(list(rel.with_suffix("").parts), folders)
        package = ".".join(["millstream", "engine", *rel.parts[:-1]])
        for name in sorted(_imports(path, package)):
            if not name.startswith("millstream.engine."):
                continue
            layer = _engine_layer(name.split(".")[2:], folders)
            if rank[layer] > rank[own]:
                upward.append(f"engine/{rel} ({own}) imports {name} ({layer})")
    assert not upward, "a lower layer imports an upper one:\n" + "\n".join(upward)


def test_the_engine_flags_import_no_torch():
    """engine/config.py reads DEFAULT_MEM_FRACTION from kv/sizing.py, which imports torch only
    when it asks the GPU: parsing the engine's flags stays light."""
    code = "import sys, millstream.engine.config; sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"millstream.engine.config imports torch: {proc.stderr}"


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


def _layout_entries() -> dict[str, str]:
    """docs/architecture.md's Layout block, services/ part: folder -> the text beside it
    (continuation lines included), folders by their indentation under services/."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    stack: list[str] = []
    current = None
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        entry = re.match(r"^( +)([a-z_]+(?:/[a-z_]+)*)/(\s+|$)(.*)", line)
        if entry and indent >= 2:
            depth = indent // 2 - 1
            stack = [*stack[:depth], entry.group(2)]
            current = "/".join(stack)
            entries[current] = entry.group(4)
        elif line.startswith(" ") and current is not None:
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_the_layout_in_the_docs_is_the_tree():
    """Every package under services/ has its line in docs/architecture.md's Layout, and that
    line names each of its modules: a module added, moved or removed changes the doc too."""
    entries = _layout_entries()
    services = REPO / "services"
    packages = {
        str(init.parent.relative_to(services))
        for init in services.rglob("__init__.py")
        if init.parent != services
    }
    assert set(entries) == packages, (
        f"folders in the doc but not the tree: {sorted(set(entries) - packages)}; "
        f"in the tree but not the doc: {sorted(packages - set(entries))}"
    )
    unnamed = {
        folder: [
            p.stem
            for p in sorted((services / folder).glob("*.py"))
            if p.stem != "__init__" and not re.search(rf"\b{p.stem}\b", text)
        ]
        for folder, text in entries.items()
    }
    assert not any(unnamed.values()), {f: names for f, names in unnamed.items() if names}
