"""native.cpp, built for this torch and loaded: the CUDA device guard and hooks that let
autograd run on the simulated device (the package's docstring says why).

Built once per source and torch version with the machine's g++ into ~/.cache/millstream
(a few seconds; `MILLSTREAM_SIM_CUDA_CACHE` moves it), by a plain compiler call: it needs
torch's headers and libraries, which its wheel ships, and no Python headers or ninja.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.cpp")


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "millstream" / "sim_cuda"
    return Path(os.environ.get("MILLSTREAM_SIM_CUDA_CACHE", default))


def _build(out: Path) -> None:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError(
            "simulated CUDA needs a C++ compiler (g++) to build its device guard for "
            "autograd; install g++ or set CXX"
        )
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        command = [
            compiler, "-shared", "-fPIC", "-O1", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-I", str(root / "include"), str(SOURCE), "-o", str(built),
            "-L", str(root / "lib"), "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-4000:]}")
        os.replace(built, out)  # whole or not at all, as several test workers may build it


@functools.cache
def library() -> ctypes.CDLL:
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    path = _cache_dir() / f"native-{key}.so"
    if not path.exists():
        _build(path)
    lib = ctypes.CDLL(str(path))
    lib.millstream_sim_cuda_enable.argtypes = [ctypes.c_int]
    lib.millstream_sim_cuda_enable.restype = ctypes.c_int
    return lib


def enable(on: bool) -> None:
    """Installs (True) or removes (False) the device guard and hooks."""
    if library().millstream_sim_cuda_enable(int(on)) < 0:
        raise RuntimeError("simulated CUDA runs on torch's CPU build only (this one has CUDA)")
