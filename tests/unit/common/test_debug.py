"""`kill -USR2` prints where each asyncio task of a service waits (common/debug.py)."""

from __future__ import annotations

import asyncio
import os
import signal

from millstream.common import debug


def test_sigusr2_prints_every_task_with_the_line_it_waits_on(capsys):
    async def waits_for_a_batch() -> None:
        await asyncio.sleep(30)

    async def go() -> None:
        debug.dump_tasks_on_sigusr2()
        waiting = asyncio.create_task(waits_for_a_batch(), name="batch-wait")
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGUSR2)
        await asyncio.sleep(0.2)  # the loop runs the handler
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(go())
    err = capsys.readouterr().err
    assert "asyncio task(s)" in err and "task batch-wait:" in err
    assert "in waits_for_a_batch" in err and "await asyncio.sleep(30)" in err


def test_a_compiled_coroutine_without_line_numbers_does_not_stop_the_dump(capsys):
    """grpc.aio's server runs Cython coroutines whose frames have no line number: asyncio's
    own Task.print_stack raised a TypeError on them, and the dump stopped there."""
    import grpc

    async def go() -> None:
        server = grpc.aio.server()
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        waiting = asyncio.create_task(server.wait_for_termination(), name="a-serving")
        after = asyncio.create_task(asyncio.sleep(30), name="b-after")
        await asyncio.sleep(0.2)
        debug.dump_tasks()
        await server.stop(0)  # ends wait_for_termination
        after.cancel()
        await asyncio.gather(waiting, after, return_exceptions=True)

    asyncio.run(go())
    err = capsys.readouterr().err
    assert "task a-serving:" in err and "task b-after:" in err
