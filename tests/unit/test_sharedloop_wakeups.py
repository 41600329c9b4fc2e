"""``SharedLoop.call_soon_threadsafe`` wakes the loop only where it waits: never a handoff lost.

A handoff from another thread while the loop's thread runs writes nothing to the self-pipe (the loop
looks at its ready queue before it waits); one while it waits, or has just chosen to wait, wakes it.
A lost wake-up would leave a callback in the queue of a loop asleep with nothing else to wake it:
here every callback must run within ``LATE_S`` of its handoff, with the GIL switched between threads
as often as the interpreter allows, so that handoffs land in every gap of the loop's turn."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from cachefs.fuse.sharedloop import SharedLoop

THREADS = 3
HANDOFFS = 2000  # per thread
LATE_S = 2.0  # far above any scheduling delay; a lost wake-up waits for the test's own deadline
DEADLINE_S = 60.0
WAIT_S = 10.0  # the wait in the window test: far longer than LATE_S


@pytest.fixture
def fast_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_no_handoff_waits_for_a_wake_up_that_never_comes(fast_switching: None) -> None:
    async def main() -> tuple[float, int, int]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, SharedLoop)
        late = [0.0]
        count = [0]
        done = asyncio.Event()

        def ran(handed_at: float) -> None:
            late[0] = max(late[0], time.monotonic() - handed_at)
            count[0] += 1
            if count[0] == THREADS * HANDOFFS:
                done.set()

        def producer(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(HANDOFFS):
                loop.call_soon_threadsafe(ran, time.monotonic())
                if rng.random() < 0.5:
                    time.sleep(rng.random() * 2e-4)  # the loop often waits in between

        threads = [threading.Thread(target=producer, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        try:
            await asyncio.wait_for(done.wait(), DEADLINE_S)
        finally:
            for thread in threads:
                thread.join(DEADLINE_S)
        return late[0], count[0], loop.wakes_skipped

    with asyncio.Runner(loop_factory=SharedLoop) as runner:
        latest, count, skipped = runner.run(main())
    assert count == THREADS * HANDOFFS
    assert latest < LATE_S, f"a callback ran {latest:.1f} s after its handoff: a wake-up was lost"
    assert 0 < skipped < count  # both kinds of handoff happened: to a running loop and to a waiting one


def test_a_handoff_between_the_loops_look_at_its_queue_and_its_wait_is_not_lost() -> None:
    """The window no stress test reaches reliably, made on purpose: the loop has looked at its ready
    queue (empty: it will wait), another thread hands a callback over before the wait begins (the
    loop still runs, so nothing is written to the self-pipe), then the loop waits. The wait must see
    the callback and return at once, not sleep until a timeout (or for ever)."""
    loop = SharedLoop()
    try:
        selector = loop._selector_with_lock
        assert not loop._ready and selector.wakes_at == -math.inf  # running: handoffs write nothing
        thread = threading.Thread(target=loop.call_soon_threadsafe, args=(lambda: None,))
        thread.start()
        thread.join(DEADLINE_S)
        assert loop.wakes_skipped == 1 and len(loop._ready) == 1
        started = time.monotonic()
        selector.select(WAIT_S)  # the wait _run_once chose before the handoff (state_lock held: ours)
        assert time.monotonic() - started < LATE_S, "the loop slept with a callback in its queue"
        assert selector.wakes_at == -math.inf
    finally:
        loop.close()


def test_a_handoff_queued_while_the_loop_goes_to_wait_wakes_it() -> None:
    """The other window: the handing thread has started its handoff while the loop ran, and queues the
    callback only once the loop waits. It must then see the loop waiting and wake it (it reads the
    loop's state after queueing; read before, it would have seen a running loop and written nothing)."""
    loop = SharedLoop()
    selector = loop._selector_with_lock
    entered = threading.Event()
    queue = loop._call_soon  # type: ignore[attr-defined]

    def queue_once_the_loop_waits(*args: object) -> object:
        entered.set()
        deadline = time.monotonic() + LATE_S
        while selector.wakes_at == -math.inf and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # the loop is in its wait by now
        return queue(*args)

    loop._call_soon = queue_once_the_loop_waits  # type: ignore[attr-defined]
    try:
        thread = threading.Thread(target=loop.call_soon_threadsafe, args=(lambda: None,))
        thread.start()
        assert entered.wait(DEADLINE_S)
        started = time.monotonic()
        selector.select(WAIT_S)  # the loop's wait (state_lock held: ours), as its turn would make it
        assert time.monotonic() - started < LATE_S, "the loop slept with a callback in its queue"
        thread.join(DEADLINE_S)
        assert loop.wakes_skipped == 0 and len(loop._ready) == 1  # type: ignore[attr-defined]
    finally:
        loop.close()


def test_a_handoff_to_a_waiting_loop_wakes_it_at_once() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        handed = []

        def hand_over() -> None:
            time.sleep(0.2)  # the loop is asleep by now, with no timer to wake it
            handed.append(time.monotonic())
            loop.call_soon_threadsafe(woken.set)

        thread = threading.Thread(target=hand_over)
        thread.start()
        await asyncio.wait_for(woken.wait(), DEADLINE_S)
        thread.join(DEADLINE_S)
        return time.monotonic() - handed[0]

    with asyncio.Runner(loop_factory=SharedLoop) as runner:
        assert runner.run(main()) < LATE_S


def test_a_closed_loop_refuses_a_handoff() -> None:
    loop = SharedLoop()
    loop.close()
    with pytest.raises(RuntimeError):
        loop.call_soon_threadsafe(lambda: None)
