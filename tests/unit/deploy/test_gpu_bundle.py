"""The GPU machine's bundle: what `make gpu-bundle` carries (scripts/gpu_wheels.txt) beside what
the machine's image holds (scripts/gpu_image.txt), against what millstream imports.

Fast, in make test: every third-party module imported anywhere in services/, bench/,
tests/support/ and examples/ (bench/gpu_imports.py's scan: top-level and function-level
imports), but the OPTIONAL ones, belongs to a distribution of the image or of the wheels;
every carried wheel's own requirements (for the GPU's Python 3.12) are there too; the wheels
are pinned at scripts/constraints.txt's versions, which this venv runs.

Long (make test-long: it downloads the wheels): the CPU dry run of scripts/gpu_check.sh's
`.gpu` branch. A bundle made for this machine's Python, and a stand-in for the image's Python
that has only the image's distributions (this venv's files of them, linked, nothing else): the
set-up installs the carried wheels, imports every module the run imports, runs the tests
stage; without tenacity's wheel, the set-up stops and names it.
"""

import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import gpu_api
import gpu_imports

REPO_ROOT = Path(__file__).resolve().parents[3]
IMAGE = REPO_ROOT / "scripts" / "gpu_image.txt"
WHEELS = REPO_ROOT / "scripts" / "gpu_wheels.txt"
CONSTRAINTS = REPO_ROOT / "scripts" / "constraints.txt"
REHEARSAL = REPO_ROOT / "scripts" / "gpu_rehearsal.txt"
# Import names packages_distributions() cannot map to one distribution of this venv, by their
# longest dotted prefix: namespace packages that several distributions share, and what the
# image holds but this venv does not.
NAMED = {
    "google.protobuf": "protobuf",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry": "opentelemetry-api",  # trace, context, propagate: the API's
    "pyarrow": "pyarrow",  # Miles' parquet data (the image's; not installed here)
}
GPU_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(path: Path) -> dict[str, str]:
    """{normalized name: pinned version or ""} of a package list, one a line, # comments."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[_norm(name)] = version
    return found


def distribution_of(module: str, packages: dict[str, list[str]]) -> str:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in NAMED:
            return NAMED[".".join(parts[:i])]
    dists = sorted(set(packages.get(parts[0], [])))
    assert len(dists) == 1, f"{module}: distributions {dists}: name it in NAMED"
    return dists[0]


def _needed() -> dict[str, set[str]]:
    """{distribution: files importing it} of every module imported that is not OPTIONAL."""
    packages = md.packages_distributions()
    needed: dict[str, set[str]] = {}
    for module, files in gpu_imports.third_party().items():
        if not gpu_imports.is_optional(module):
            needed.setdefault(_norm(distribution_of(module, packages)), set()).update(files)
    return needed


def test_every_module_imported_is_in_the_image_or_carried():
    image, wheels = _listed(IMAGE), _listed(WHEELS)
    needed = _needed()
    assert {"torch", "tenacity", "fastapi", "redis"} <= set(needed), sorted(needed)
    missing = {d: sorted(files)[:3] for d, files in needed.items() if d not in image | wheels}
    assert not missing, (
        f"imported, but neither in the GPU image (scripts/gpu_image.txt) nor carried "
        f"(scripts/gpu_wheels.txt): {missing}; add it there at scripts/constraints.txt's "
        f"version, or to bench/gpu_imports.py's OPTIONAL with the reason it is not needed"
    )


def test_every_carried_wheel_has_its_requirements_and_its_pinned_version():
    image, wheels = _listed(IMAGE), _listed(WHEELS)
    pins = _listed(CONSTRAINTS)
    environment = {**default_environment(), **GPU_PYTHON}
    problems = []
    for name, version in wheels.items():
        if version != pins.get(name):
            problems.append(f"{name}=={version}: scripts/constraints.txt pins {pins.get(name)}")
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            problems.append(f"{name}: not installed here, its requirements unread")
            continue
        if dist.version != version:
            problems.append(f"{name}: {dist.version} here, {version} carried")
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = req.marker is None or req.marker.evaluate(environment)
            if wanted and _norm(req.name) not in image | wheels:
                problems.append(f"{name} requires {req}: neither in the image nor carried")
    assert not problems, "\n".join(problems)


def test_the_rehearsal_stands_in_for_the_image_at_its_versions():
    """`make gpu-rehearsal`'s venv (scripts/gpu_rehearsal.txt): every image package the run
    imports, none that the bundle carries, at the image's version where it is known, else at
    scripts/constraints.txt's."""
    image, wheels, pins = _listed(IMAGE), _listed(WHEELS), _listed(CONSTRAINTS)
    rehearsal = _listed(REHEARSAL)
    needed_from_image = {d for d in _needed() if d in image and d not in wheels}
    assert needed_from_image <= set(rehearsal), sorted(needed_from_image - set(rehearsal))
    assert {"torch", "transformers", "pytest-timeout"} <= set(rehearsal)
    problems = [f"{name}: carried (scripts/gpu_wheels.txt), not the image's"
                for name in rehearsal if name in wheels]  # fmt: skip
    for name, version in rehearsal.items():
        if name not in image:
            problems.append(f"{name}: not in the image (scripts/gpu_image.txt)")
        elif image[name] and version != image[name]:
            problems.append(f"{name}=={version}: the image holds {image[name]}")
        elif not image[name] and name in pins and version != pins[name]:
            problems.append(f"{name}=={version}: scripts/constraints.txt pins {pins[name]}")
        elif not version:
            problems.append(f"{name}: not pinned")
    assert not problems, "\n".join(problems)
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"


def test_the_api_scan_names_what_this_torch_lacks_and_the_tree_uses_none(tmp_path):
    """bench/gpu_api.py: a torch name this torch lacks, through an import alias, and a keyword
    a signature refuses (as 2.11's DistributedDataParallel refused forward_sync_buffers) are
    named with their place; what exists is not. The whole scanned tree passes on this torch
    (the GPU set-up and `make gpu-rehearsal` run it on the image's)."""
    f = tmp_path / "uses.py"
    f.write_text(
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.cuda import no_such_import\n"
        "a = torch.cuda.no_such_thing.either\n"
        "b = F.no_such_function\n"
        "DDP(None, no_such_keyword=False)\n"
        "DDP(None, device_ids=None, process_group=None)\n"
        "torch.cuda.is_available()\n"
        "F.scaled_dot_product_attention\n"
    )
    judged, refused = gpu_api.check([f])
    assert [line.split(":")[0] for line in refused] == [
        "torch.cuda.no_such_import",
        "torch.cuda.no_such_thing",
        "torch.nn.functional.no_such_function",
        "torch.nn.parallel.DistributedDataParallel(no_such_keyword=...)",
    ], refused
    assert "uses.py:4)" in refused[0] and "uses.py:7)" in refused[-1], refused  # where
    judged, refused = gpu_api.check(gpu_imports.python_files())
    assert judged > 200 and not refused, refused


def test_the_sweep_stops_only_for_a_package_that_is_missing():
    """A missing package stops the GPU set-up (every stage would die of it); a submodule or a
    name an installed package lacks (a version skew) is named, and the stages go on."""
    assert gpu_imports.absent(ModuleNotFoundError("x", name="tenacity_not_here")) == (
        "tenacity_not_here"
    )
    assert gpu_imports.absent(ModuleNotFoundError("x", name="json.not_here")) is None
    assert gpu_imports.absent(ImportError("cannot import name 'X' from 'json'")) is None


def _stand_in(image: set[str], carried: set[str]) -> set[str]:
    """The image's distributions as this venv has them, and their requirements here: this
    venv's versions may need more than the image's own do (huggingface_hub 2.4 needs httpx2,
    the image's 1.33 does not). Never one only the bundle carries: that is what is checked."""
    found, todo = set(), [d for d in image if _installed(d)]
    while todo:
        name = todo.pop()
        if name in found or name in carried - image or not _installed(name):
            continue
        found.add(name)
        for line in md.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**default_environment(), "extra": ""}):
                todo.append(_norm(req.name))
    return found


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def _image_python(root: Path) -> Path:
    """A stand-in for the image's Python (module docstring): a venv of this interpreter without
    site packages, its site-packages linking this venv's files of the image's distributions
    (_stand_in) and nothing else. Where one top-level folder is shared (google/, a namespace),
    it is made and only the image's entries are linked. Returns its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    (site,) = root.glob("lib/python*/site-packages")
    here = Path(str(md.distribution("pytest").locate_file("")))
    image = _stand_in(set(_listed(IMAGE)), set(_listed(WHEELS)))
    owners: dict[tuple[str, ...], set[str]] = {}
    for dist in md.distributions():
        if Path(str(dist.locate_file(""))) != here:
            continue
        for f in dist.files or []:
            parts = Path(f).parts
            if parts[0] != "..":  # a script in bin/
                for depth in range(1, len(parts) + 1):
                    owners.setdefault(parts[:depth], set()).add(_norm(dist.metadata["Name"]))

    def link(entry: tuple[str, ...]) -> None:
        who, source = owners[entry], here.joinpath(*entry)
        if who <= image or (who & image and not source.is_dir()):
            site.joinpath(*entry).symlink_to(source)
        elif who & image:
            site.joinpath(*entry).mkdir()
            for child in sorted(e for e in owners if len(e) == len(entry) + 1 and e[:-1] == entry):
                link(child)

    for top in sorted(e for e in owners if len(e) == 1):
        link(top)
    return root / "bin"


@pytest.mark.long
@pytest.mark.timeout(900)  # 271 s alone on 2 cores (the download, then a check run), past 300 busy
def test_the_gpu_set_up_imports_the_run_from_the_image_and_the_carried_wheels(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PY", "MILLSTREAM",
                        "MILLSTREAM_COMMIT", "MILLSTREAM_GPU_CHECK_T0")}  # fmt: skip
    bundle = tmp_path / "bundle"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    made = subprocess.run(["bash", "scripts/gpu_bundle.sh"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=900,
                          env={**env, "GPU_BUNDLE": str(bundle), "GPU_PYTHON": python})  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    assert (bundle / "python-version").read_text().strip() == python
    assert (bundle / "commit").read_text().strip() not in ("", "unknown")
    # What the image lacks and this venv cannot stand in for is left out of the sweep.
    image, installed = set(_listed(IMAGE)), {_norm(d.metadata["Name"]) for d in md.distributions()}
    packages = md.packages_distributions()
    skip = sorted({m.split(".")[0] for m in gpu_imports.third_party()
                   if not gpu_imports.is_optional(m)
                   and _norm(distribution_of(m, packages)) in image - installed})  # fmt: skip
    env |= {"PATH": f"{_image_python(tmp_path / 'image')}:{env['PATH']}",
            "GPU_BUNDLE": str(bundle), "GPU_SITE": str(tmp_path / "site"),
            "GPU_IMPORTS_SKIP": ",".join(skip)}  # fmt: skip

    def check(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--small",
                               "--no-docs", "--out", str(tmp_path / "out"), "--work",
                               str(tmp_path / "work"), *args], cwd=REPO_ROOT,
                              env=env, capture_output=True, text=True, timeout=900)  # fmt: skip

    run = check("--stages", "tests")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "installing the carried wheels" in run.stderr  # the .gpu branch, not this venv
    assert re.search(r"\[gpu-imports\] all \d+ modules import", run.stderr), run.stderr[-2000:]
    all_there = r"\[gpu-api\] torch \S+: (\d+) of \1 torch names"
    assert re.search(all_there, run.stderr), run.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["environment"]["python"] == platform.python_version()
    tests = [r for r in report["rows"] if r[0].startswith("test ")]
    assert len(tests) >= 10 and {r[3] for r in tests} == {"skip"}, tests
    # The list as it was before tenacity was added: the set-up stops and names it.
    next(bundle.glob("whl/tenacity-*.whl")).unlink()
    stopped = check("--stages=")
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert "No module named 'tenacity'" in stopped.stderr
    assert "add the wheels to scripts/gpu_wheels.txt" in stopped.stderr
