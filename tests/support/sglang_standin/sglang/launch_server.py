"""`python -m sglang.launch_server` of the stand-in (see __init__): records its command line
(one JSON line per start, to $SGLANG_STANDIN_RECORD when set), refuses what real SGLang would
need a GPU or several for, and runs millstream's engine with the SGLang arguments translated."""

from __future__ import annotations

import json
import os
import sys

# SGLang server flags millstream's engine spells the same (the value kept), and those it drops.
SAME = {
    "--model-path", "--host", "--port", "--weight-version", "--mem-fraction-static",
    "--context-length", "--log-level", "--cuda-graph-max-bs", "--max-running-requests",
    "--max-total-tokens", "--dtype", "--device",
}  # fmt: skip
RENAMED = {"--random-seed": "--seed"}
SWITCHES = {"--disable-cuda-graph"}
DROPPED_SWITCHES = {"--enable-memory-saver"}  # the engine releases memory without it


def translate(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        name = argv[i]
        if name in ("--tp-size", "--tp"):
            if argv[i + 1] != "1":
                sys.exit(f"sglang stand-in: --tp-size {argv[i + 1]} needs {argv[i + 1]} GPUs")
            i += 2
        elif name in SWITCHES:
            out.append(name)
            i += 1
        elif name in DROPPED_SWITCHES:
            i += 1
        elif name in SAME or name in RENAMED:
            out += [RENAMED.get(name, name), argv[i + 1]]
            i += 2
        else:
            sys.exit(f"sglang stand-in: {name} is not a server flag this stand-in knows")
    return out


def main() -> None:
    argv = sys.argv[1:]
    record = os.environ.get("SGLANG_STANDIN_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps(argv) + "\n")
    from millstream.engine.main import main as engine_main

    sys.exit(engine_main(translate(argv)))


if __name__ == "__main__":
    main()
