"""`millstream <command>`: one thin entry per service; heavy imports happen in the command.

Each command maps to `millstream.<pkg>.main:main(argv) -> int`. Errors the user can act on
(MillstreamError) print one line and exit 1; flag errors exit 2 (argparse).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from millstream.common.errors import MillstreamError

# Every child a millstream process starts is forked and exec'd at once (services, Redis,
# torchrun ranks); none runs gRPC after a fork. gRPC's fork handlers, on by default, restart
# its pollers in the child between fork and exec, where closing the inherited descriptors
# breaks them: one child in ~15 died that way while the parent had gRPC threads busy (the
# trainer serves the Coordinator; a test process has clients). Read when grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "millstream.trainer.main:train",
        "sync RL training (strictly on-policy, like Miles' train.py)",
    ),
    "train-async": (
        "millstream.trainer.main:train_async",
        "async RL training (--max-staleness >= 1)",
    ),
    "engine": (
        "millstream.engine.main:main",
        "millstream's inference engine, speaking SGLang's HTTP API (CPU or GPU)",
    ),
    "router": ("millstream.router.main:main", "HTTP router in front of engines"),
    "rollout": ("millstream.rollout.main:main", "rollout worker: {run}:prompts -> {run}:generated"),
    "reward": ("millstream.reward.main:main", "reward worker: {run}:generated -> {run}:scored"),
    "reward-celery": ("millstream.reward.main:celery_worker", "Celery worker running reward tasks"),
    "plan": (
        "millstream.launch.plan:main",
        "print the GPU plan of `train` flags ([--gpus N]; starts nothing)",
    ),
    "gpus": ("millstream.launch.plan:gpus_main", "print how many GPUs torch sees here"),
    "trace": ("millstream.tools.trace_cli:main", "summarise a run's traces"),
    "plot": ("millstream.trainer.observe.plot:main", "draw a run's metric curves"),
    "convert": (
        "millstream.trainer.checkpoints.convert:main",
        "Hugging Face <-> Megatron torch_dist checkpoints (Miles' conversion tools)",
    ),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: millstream <command> [flags...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    lines += ["", "`millstream <command> --help` lists a command's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"millstream: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how to see where a service
    # that hangs is waiting, without stopping it (and USR2 its asyncio tasks: common/debug.py).
    with contextlib.suppress(AttributeError, ValueError, OSError):  # stderr without a file
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and err.name.startswith("millstream"):
            print(
                f"millstream: `{name}` is not built yet ({module_name} is missing)", file=sys.stderr
            )
            return 2
        raise
    try:
        return int(getattr(module, func_name)(rest) or 0)
    except MillstreamError as err:
        print(f"millstream {name}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"millstream {name}: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `millstream` script and `python -m millstream.cli`: `main`, then a quick exit."""
    code = main()
    # The interpreter's last garbage collections walk every object torch and transformers
    # made: 0.7-1.3 s of every service's exit on 2 cores, measured. The process has closed
    # what it opened; its memory goes back to the OS without the walk.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
