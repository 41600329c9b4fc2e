"""Small asyncio helpers shared by the write-back collaborators."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from tiering.errors import CacheError


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout`` passes; True if set. Unlike ``asyncio.wait_for`` on
    Python 3.11, a cancellation arriving as the event is set is never swallowed."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()
    return event.is_set()


def describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, (CacheError, OSError)) else f"{type(exc).__name__}: {text}"


class KeyLocks:
    """One asyncio lock per key, created on demand and dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, list[Any]] = {}  # key -> [lock, users]

    @contextlib.asynccontextmanager
    async def hold(self, *keys: str) -> AsyncIterator[None]:
        held: list[str] = []
        try:
            for key in sorted(set(keys)):  # one global order: no deadlock between two renames
                slot = self._locks.setdefault(key, [asyncio.Lock(), 0])
                slot[1] += 1
                try:
                    await slot[0].acquire()
                except BaseException:
                    self._drop(key)
                    raise
                held.append(key)
            yield
        finally:
            for key in reversed(held):
                self._locks[key][0].release()
                self._drop(key)

    def _drop(self, key: str) -> None:
        slot = self._locks[key]
        slot[1] -= 1
        if slot[1] == 0:
            del self._locks[key]
