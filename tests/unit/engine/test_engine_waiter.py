"""The engine's Waiter: how the scheduler thread wakes the request handler on the event loop."""

from __future__ import annotations

import asyncio
import random
import threading

from millstream.engine.http.generation import Waiter
from millstream.engine.sampling import SamplingParams
from millstream.engine.sequence import FinishReason, Sequence


def _seq() -> Sequence:
    return Sequence(rid="r", prompt_ids=[1, 2], params=SamplingParams(), rng=random.Random(0))


def test_changes_from_another_thread_coalesce_into_few_wake_ups():
    """A burst of changes (every token of every sequence of a step) wakes the task once or
    a few times, not once per change; each wake-up sees the changes made before it."""

    async def scenario() -> tuple[int, int]:
        waiter, seq = Waiter(), _seq()
        scheduled = 0
        real = waiter._loop.call_soon_threadsafe

        def counting(*args):
            nonlocal scheduled
            scheduled += 1
            return real(*args)

        waiter._loop.call_soon_threadsafe = counting  # type: ignore[method-assign]

        def burst() -> None:
            for token in range(500):
                seq.output_ids.append(token)
                waiter(seq)

        thread = threading.Thread(target=burst)
        thread.start()
        await asyncio.to_thread(thread.join)
        await asyncio.wait_for(waiter.wait(), 5)
        return scheduled, len(seq.output_ids)

    scheduled, seen = asyncio.run(scenario())
    assert seen == 500
    assert 1 <= scheduled < 50


def test_a_waiter_for_the_end_wakes_only_when_a_sequence_finishes():
    async def scenario() -> tuple[bool, bool]:
        waiter, seq = Waiter(), _seq()
        waiter.finishes_only()
        seq.output_ids.append(7)
        waiter(seq)  # a token: no wake-up
        try:
            await asyncio.wait_for(waiter.wait(), 0.2)
            woke_on_token = True
        except TimeoutError:
            woke_on_token = False
        seq.set_finished(FinishReason("length", length=1), "v1")
        waiter(seq)
        await asyncio.wait_for(waiter.wait(), 5)
        return woke_on_token, seq.done

    woke_on_token, done = asyncio.run(scenario())
    assert not woke_on_token and done
