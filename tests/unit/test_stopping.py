"""``cachefs.daemon.stopping``: the first signal drains while serving, then ends the session; a second
ends it at once and abandons every wait; the deadline bounds whatever is waited for."""

from __future__ import annotations

import asyncio

from cachefs.daemon.stopping import Stopping


async def test_the_first_signal_drains_then_ends_the_session() -> None:
    stopping = Stopping(30)
    release = asyncio.Event()
    order: list[str] = []

    async def drain() -> None:
        order.append("drain")
        await release.wait()
        order.append("drained")

    stopping.on_drain(drain)
    ended = asyncio.Event()
    stopping.signalled("SIGTERM", lambda: (order.append("end"), ended.set()))
    await asyncio.sleep(0.01)
    assert order == ["drain"], "the session ended before the drain (it must go on serving meanwhile)"
    release.set()
    await asyncio.wait_for(ended.wait(), 1)
    assert order == ["drain", "drained", "end"]
    await stopping.close()


async def test_a_second_signal_ends_the_session_at_once_and_abandons_waits() -> None:
    stopping = Stopping(30)
    never = asyncio.Event()

    async def drain() -> None:
        await never.wait()

    stopping.on_drain(drain)
    ends: list[str] = []
    stopping.signalled("SIGTERM", lambda: ends.append("end"))
    await asyncio.sleep(0.01)
    assert ends == []
    stopping.signalled("SIGTERM", lambda: ends.append("end"))
    assert ends == ["end"]
    assert stopping.remaining() == 0
    assert await asyncio.wait_for(stopping.bounded(never.wait()), 1) is None
    await stopping.close()


async def test_the_deadline_bounds_what_is_waited_for_and_starts_once() -> None:
    now = [100.0]
    stopping = Stopping(5, clock=lambda: now[0])
    assert not stopping.begun
    stopping.begin()  # the session ended (an unmount)
    now[0] += 3
    stopping.begin()  # a later signal does not restart it
    assert stopping.remaining() == 2
    now[0] += 10
    assert stopping.remaining() == 0
    assert await asyncio.wait_for(stopping.bounded(asyncio.sleep(60)), 1) is None
    fresh = Stopping(5)
    assert await fresh.bounded(asyncio.sleep(0, result="done")) == "done"


async def test_unmount_force_skips_the_drain() -> None:
    stopping = Stopping(30)
    drained: list[str] = []

    async def drain() -> None:
        drained.append("drain")

    stopping.on_drain(drain)
    stopping.skip_drain = True
    ends: list[str] = []
    stopping.signalled("SIGTERM", lambda: ends.append("end"))
    await asyncio.sleep(0.01)
    assert ends == ["end"] and drained == []
    assert stopping.remaining() == 0


async def test_a_signal_after_an_unmount_lets_the_upload_go_on_and_a_second_stops_it() -> None:
    stopping = Stopping(30)

    async def drain() -> None:
        raise AssertionError("the session is gone: nothing to drain while serving")

    stopping.on_drain(drain)
    stopping.session_ended()  # umount, fusermount3 -u: systemd then signals what is left of the unit
    ends: list[str] = []
    stopping.signalled("SIGTERM", lambda: ends.append("end"))
    await asyncio.sleep(0.01)
    assert stopping.remaining() > 0 and not stopping.abandoned.is_set()
    stopping.signalled("SIGTERM", lambda: ends.append("end"))
    assert stopping.abandoned.is_set() and stopping.remaining() == 0
