"""The package layout of DESIGN.md section 2, and the light imports STYLE.md asks for."""

from __future__ import annotations

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


@pytest.mark.parametrize("folder", ["common", "router", "engine", "rollout", "reward", "trainer"])
def test_services_never_import_each_other(folder):
    others = {"router", "engine", "rollout", "reward", "trainer"} - {folder}
    for path in (REPO / "services" / folder).rglob("*.py"):
        text = path.read_text()
        for other in others:
            assert f"millstream.{other}" not in text, f"{path} imports millstream.{other}"


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
