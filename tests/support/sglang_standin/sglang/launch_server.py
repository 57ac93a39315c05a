"""`python -m sglang.launch_server` of the stand-in (see __init__).

1. Records its command line (one JSON line per start, to $SGLANG_STANDIN_RECORD when set).
2. Lets SGLang judge it: the real package's `prepare_server_args` and `resolve_once`, as its
   launch_server runs them, in a child process (`python -m tests.support.sglang_contract`
   with .venv/sglang on the path: `sglang` must not be importable here, and importing it
   takes seconds). A flag SGLang does not know, or a setting it refuses for this model or
   device, stops the start with SGLang's own message and exit status, as the real server
   would. Without .venv/sglang it stops, saying to run scripts/bootstrap.sh.
3. Runs millstream's engine with the settings SGLang parsed, each under the engine's flag
   for it: the launcher's own (model, address, weight version, device) spelled the same, the
   others through the launcher's table (engines.SGLANG_TO_ENGINE), so the stand-in keeps no
   list of SGLang's flags. A TP above 1 stops the start (it needs that many GPUs); the memory
   saver is dropped (the engine releases its memory without it); any other setting SGLang
   took is named on stderr and left out, since the engine has no such thing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from millstream.launch.engines import SGLANG_TO_ENGINE

REPO = Path(__file__).resolve().parents[4]
CHILD = "tests.support.sglang_contract"
SAME = ("--model-path", "--host", "--port", "--weight-version", "--device")


def parse_as_sglang(argv: list[str]) -> list[tuple[str, object]]:
    """[flag, value] for each setting SGLang parsed from `argv` (the child's JSON line); exits
    as SGLang does when it refuses them."""
    sglang = REPO / ".venv" / "sglang"
    if not (sglang / "sglang").is_dir():
        sys.exit(
            f"sglang stand-in: SGLang's package is not in {sglang}, and it judges the command "
            "line: run scripts/bootstrap.sh (it installs it there)"
        )
    # SGLang's folder and this repository, and not the stand-in's: its `sglang` would shadow.
    # With SGLANG_USE_CPU_ENGINE=1 (the launcher's, for a CPU engine) SGLang's modules import
    # two CPU ops from sgl_kernel: the live tier's stand-in for that package serves them.
    path = [str(sglang), str(REPO), str(REPO / "tests" / "sglang_live" / "kernel_standin")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run(
        [sys.executable, "-m", CHILD, *argv], env=env, stdout=subprocess.PIPE, text=True
    )  # SGLang's messages go to stderr, the engine's log
    if proc.returncode:
        print("sglang stand-in: SGLang refused the command line (above)", file=sys.stderr)
        sys.exit(proc.returncode)
    *chatter, line = proc.stdout.splitlines()
    sys.stderr.write("".join(text + "\n" for text in chatter))
    return [(flag, value) for flag, value in json.loads(line)]


def translate(settings: list[tuple[str, object]]) -> list[str]:
    """millstream engine flags for SGLang's parsed settings (module docstring, step 3)."""
    out: list[str] = []
    for flag, value in settings:
        if flag == "--tp-size":
            if value != 1:
                sys.exit(f"sglang stand-in: --tp-size {value} needs {value} GPUs")
        elif flag == "--enable-memory-saver":
            continue
        elif flag in SAME or flag in SGLANG_TO_ENGINE:
            name = SGLANG_TO_ENGINE.get(flag, flag)
            out += [name] if value is True else [name, str(value)]
        else:
            print(f"sglang stand-in: the engine has no {flag} ({value}): left out", file=sys.stderr)
    return out


def main() -> None:
    argv = sys.argv[1:]
    record = os.environ.get("SGLANG_STANDIN_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps(argv) + "\n")
    engine_argv = translate(parse_as_sglang(argv))
    from millstream.engine.main import main as engine_main

    sys.exit(engine_main(engine_argv))


if __name__ == "__main__":
    main()
