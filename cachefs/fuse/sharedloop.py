"""An asyncio loop whose state other threads may use in turn: what lets several FUSE readers answer.

The daemon's state (inodes, handles, the engine's bookkeeping) lives on the asyncio loop and is
touched only between two awaits, by one thread at a time. ``SharedLoop`` keeps that rule with
more than one thread: its ``state_lock`` is held by the loop's thread whenever it runs Python code
and released only while it waits for events (``_LockedSelector``); a FUSE reader thread that holds
the lock may then run handlers and the first step of a handler's task itself, exactly as the loop
would, and the interleavings stay those of one loop (a step between two awaits runs whole).

What a reader thread does under the lock that the loop must notice: callbacks it schedules
(``call_soon``, ``call_at``: a future completed, a task created, a timer set) land in the loop's
queues while the loop waits, so they are marked and ``wake`` has the loop look at them once the
thread lets go of the lock (a timer only if it is due before the loop wakes by itself: a read's
deadline, set on every read that waits for a load, would otherwise cost the loop a turn each).
``start_task`` creates a task whose first step runs in the calling
thread, now (the 3.12 "eager task" idea, on 3.11): a request answered without waiting never
involves the loop's thread; one that waits continues on the loop as an ordinary task.

The wait is split in two so that the selector's own bookkeeping (its map of registered files) is
only ever touched under the lock: ``poll`` on the epoll descriptor without the lock, then the
selector's ``select(0)`` with it. One more system call per loop turn, used only when several
readers were asked for (``cachefs mount --fuse-threads``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import os
import select
import selectors
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar, TypeVarTuple, Unpack

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class _LockedSelector(selectors.EpollSelector):
    """Releases ``lock`` while it waits for an event, and lets a thread that waits for the lock in
    between turns of a loop that has no time to wait (``waiting``: how many threads want it)."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self._lock = lock
        self._waiter = select.poll()
        self._waiter.register(self.fileno(), select.POLLIN)
        self.waiting = 0
        # When the loop's thread wakes by itself from the wait it is in (time.monotonic(), the loop's
        # clock; inf: only an event wakes it): a timer due no earlier needs no wake-up. Set with the
        # lock held, before the wait lets go of it. -inf while the loop's thread runs (it will look
        # at its ready queue before it waits: ``SharedLoop.call_soon_threadsafe`` wakes no one then).
        self.wakes_at = -math.inf
        # Whether the loop has callbacks ready (set by the loop): asked once ``wakes_at`` says the
        # loop is about to wait, so a callback handed over after the loop chose to wait is not missed.
        self.ready: Callable[[], bool] = lambda: False

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None or timeout > 0:
            wait_ms = -1 if timeout is None else math.ceil(timeout * 1000)
            self.wakes_at = math.inf if timeout is None else time.monotonic() + timeout
            # (Another thread queues a callback, then reads ``wakes_at``; this thread wrote
            # ``wakes_at``, now reads the queue: under the GIL one of the two sees the other's write,
            # so either that thread wakes the loop or the loop does not wait.)
            if self.ready():
                self.wakes_at = -math.inf
                return super().select(0)
            self._lock.release()
            try:
                self._waiter.poll(wait_ms)
            finally:
                self._lock.acquire()
                self.wakes_at = -math.inf
        elif self.waiting:
            # A busy loop would otherwise keep the lock from one turn to the next: readers with a
            # request in hand get their turn between two (a lock has no queue: this is best effort).
            self._lock.release()
            try:
                os.sched_yield()
            finally:
                self._lock.acquire()
        return super().select(0)


class SharedLoop(asyncio.SelectorEventLoop):
    """A selector loop (epoll) that other threads may run code on while they hold ``state_lock``.

    Create it in the thread that runs it (``asyncio.Runner(loop_factory=SharedLoop)``): that thread
    holds the lock from then on, except while it waits."""

    def __init__(self) -> None:
        self.state_lock = threading.Lock()
        self.state_lock.acquire()
        self._owner = threading.get_ident()
        self._foreign_scheduled = False
        self._captured: list[tuple[Callable[..., object], tuple[Any, ...], contextvars.Context | None]] | None = None
        self._count_lock = threading.Lock()
        self._selector_with_lock = _LockedSelector(self.state_lock)
        super().__init__(self._selector_with_lock)
        # (asyncio's own queue and checks: BaseEventLoop's private names, stable since 3.4)
        self._selector_with_lock.ready = lambda: bool(self._ready)  # type: ignore[attr-defined]
        self.wakes_skipped = 0  # handoffs that wrote nothing to the self-pipe (tests)

    def call_soon_threadsafe(self, callback: Callable[[Unpack[Ts]], object], *args: Unpack[Ts],
                             context: contextvars.Context | None = None) -> asyncio.Handle:
        """``call_soon`` from any thread, waking the loop only where it waits (or is about to): while
        its thread runs it will see the callback before it waits (``_LockedSelector.select``), and
        asyncio's own version would write to the self-pipe anyway, making the loop turn once more
        to read it. Measured alone (a thread handing 20,000 callbacks of ~5 us each to the loop):
        20,000 self-pipe writes and ~2,200 loop turns -> none and 3-5; 16-19 -> 4-8 us of CPU per
        handoff, both threads together."""
        if self.get_debug():
            return super().call_soon_threadsafe(callback, *args, context=context)
        self._check_closed()  # type: ignore[attr-defined]
        # The callback is queued first, ``wakes_at`` read after: the loop's thread writes ``wakes_at``
        # first and reads the queue after (``_LockedSelector.select``). Under the GIL one of the two
        # reads sees the other's write: either this thread sees the loop waiting (or about to) and
        # wakes it, or the loop sees the callback and does not wait. (Read first, a loop that went to
        # wait between the read and the queueing would sleep on the callback.)
        handle: asyncio.Handle = self._call_soon(callback, args, context)  # type: ignore[attr-defined]
        if self._selector_with_lock.wakes_at != -math.inf:
            self._write_to_self()  # type: ignore[attr-defined]
        else:
            self.wakes_skipped += 1
        return handle

    def wait_for_state(self) -> None:
        """Acquire ``state_lock`` (from a thread other than the loop's) where a first try without
        waiting failed, counted while waiting for it so that a busy loop lets go between two turns."""
        selector = self._selector_with_lock
        with self._count_lock:
            selector.waiting += 1
        try:
            self.state_lock.acquire()
        finally:
            with self._count_lock:
                selector.waiting -= 1

    @contextlib.contextmanager
    def holding_state(self) -> Iterator[None]:
        """Hold ``state_lock`` (from a thread other than the loop's): at once where it is free, else
        through ``wait_for_state``. (A FUSE reader takes the same two steps without this context
        manager, whose generator costs about a microsecond per request.)"""
        if not self.state_lock.acquire(False):
            self.wait_for_state()
        try:
            yield
        finally:
            self.state_lock.release()

    # Called from another thread only with ``state_lock`` held (the loop's thread is waiting then).
    def call_soon(self, callback: Callable[[Unpack[Ts]], object], *args: Unpack[Ts],
                  context: contextvars.Context | None = None) -> asyncio.Handle:
        if threading.get_ident() != self._owner:
            if self._captured is not None and not self._captured:
                self._captured.append((callback, args, context))  # the first step of start_task's task
                return asyncio.Handle(callback, args, self, context)
            self._foreign_scheduled = True
            if self.get_debug():  # (the debug loop refuses call_soon from another thread)
                return self.call_soon_threadsafe(callback, *args, context=context)
        return super().call_soon(callback, *args, context=context)

    def call_at(self, when: float, callback: Callable[[Unpack[Ts]], object], *args: Unpack[Ts],
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if threading.get_ident() != self._owner and when < self._selector_with_lock.wakes_at:
            # (A timer due after the loop's own wake-up, such as the deadline a read sets on the load
            # it waits for, is seen then: no wake-up of the loop for it.)
            self._foreign_scheduled = True
        return super().call_at(when, callback, *args, context=context)

    def start_task(self, coro: Coroutine[Any, Any, T], register: Callable[[asyncio.Task[T]], None]) -> asyncio.Task[T]:
        """A task of ``coro`` whose first step runs here, now, after ``register(task)``; the rest on
        the loop. From a thread other than the loop's, with ``state_lock`` held."""
        self._captured = []
        try:
            task = self.create_task(coro)
        finally:
            captured, self._captured = self._captured, None
        register(task)
        if not captured:  # (scheduled the ordinary way: it runs on the loop)
            self._foreign_scheduled = True
            return task
        callback, args, context = captured[0]
        if context is None:
            callback(*args)
        else:
            context.run(callback, *args)
        return task

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._owner

    def take_wake(self) -> bool:
        """Whether a thread scheduled work for the loop since the last call (with ``state_lock``
        held); if so, call ``wake`` once the lock is released."""
        scheduled, self._foreign_scheduled = self._foreign_scheduled, False
        return scheduled

    def wake(self) -> None:
        self.call_soon_threadsafe(_nothing)


def _nothing() -> None:
    pass
