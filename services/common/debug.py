"""Seeing where a live service waits, without stopping it.

`kill -USR1 <pid>`: every thread's stack (faulthandler, registered by `millstream.cli`); it
works even when the event loop is stuck in a blocking call.
`kill -USR2 <pid>`: every asyncio task's stack (`dump_tasks_on_sigusr2`, for processes that
install it in their running loop): where each coroutine is suspended, which the thread stacks
of an idle loop (all in `select`) do not show.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import traceback


def dump_tasks(file=None) -> None:  # type: ignore[no-untyped-def]
    """Print each task of the running loop with the stack it is suspended in.

    Not `Task.print_stack`: a task whose coroutine is compiled (grpc.aio's server, the
    trainer's Coordinator) has frames without a line number, and asyncio's printer raises a
    TypeError on them, losing every task after it. Here such a frame prints without its line.
    """
    out = file or sys.stderr
    tasks = asyncio.all_tasks()
    print(f"--- {len(tasks)} asyncio task(s)", file=out)
    for task in sorted(tasks, key=lambda t: t.get_name()):
        print(f"task {task.get_name()}: {task.get_coro()!r}", file=out)
        frames = task.get_stack(limit=20)
        if not frames:
            print("  (no Python frames: not started, done, or compiled code)", file=out)
            continue
        stack = traceback.StackSummary.extract(
            ((frame, frame.f_lineno) for frame in frames), lookup_lines=False
        )
        out.write("".join(stack.format()))
    out.flush()


def dump_tasks_on_sigusr2() -> None:
    """SIGUSR2 prints the running loop's tasks (call from inside the loop; no-op where the
    loop cannot take signal handlers, e.g. off the main thread)."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)
