"""How the daemon stops: what is pending is uploaded before it exits, by every route, within one deadline.

A writable mount acknowledges writes once they are on local disk (``tiering.writeback``); the store
gets them later. A daemon that stops must not leave them on a node that may never mount the source
again, so every way of stopping drains write-back first, bounded by ``--stop-timeout``
(``WriteBackSettings.stop_timeout_s``, 25 s by default: a pod's 30 s grace period less a margin):

- **SIGTERM or SIGINT** (the kubelet deleting or evicting a mount pod, ``systemctl stop``, a person):
  the daemon *keeps serving* while it uploads what is pending, then ends the FUSE session and stops
  its features; write-back's stop uploads what was acknowledged meanwhile, within what is left of the
  same deadline.
- **An unmount** (``umount``, ``fusermount3 -u``, ``cachefs unmount``, systemd stopping a mount
  unit): the kernel ends the session first (DESTROY), so the daemon can no longer serve, but it still
  uploads what is pending before it exits, within the deadline counted from then.
- **A second SIGTERM/SIGINT**, or ``cachefs unmount --force`` (which tells the daemon through the
  control socket before it unmounts): stop at once, uploading nothing more.
- **SIGKILL**: nothing runs. Nothing acknowledged is lost either way: what is not in the store stays
  journaled in the staging directory and the next mount of the source replays and uploads it.

When the deadline passes, the daemon says on stderr (the pod's log, the journal of a systemd unit;
a background mount's ``daemon.log``) how many changes stay journaled, which, and where.

``Stopping`` is the one object that knows the deadline and whether to wait at all; features ask it
(``remaining()``, ``abandoned``) and register what to drain while still serving (``on_drain``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from cachefs.daemon.control import ControlRequestError, ControlServer

log = logging.getLogger(__name__)

Drain = Callable[[], Awaitable[None]]
T = TypeVar("T")


class Stopping:
    """The stop of one daemon: its deadline, the abandon switch, and the drains run while serving."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._deadline: float | None = None
        self.abandoned = asyncio.Event()  # set: stop now, wait for nothing
        self.skip_drain = False  # `cachefs unmount --force` asked for no drain before it unmounts
        self.signals = 0
        self._drains: list[Drain] = []
        self._task: asyncio.Task[None] | None = None
        self._session_ended = False

    # -- what features use --------------------------------------------------------------------------
    def on_drain(self, drain: Drain) -> None:
        """``drain()`` runs at the first signal while the mount still serves (write-back's flush)."""
        self._drains.append(drain)

    def session_ended(self) -> None:
        """The FUSE session is over (an unmount, or the drain's end): the deadline runs from now at the latest."""
        self._session_ended = True
        self.begin()

    def begin(self) -> None:
        """Start the deadline (once: the first signal or the end of the session, whichever is first)."""
        if self._deadline is None:
            self._deadline = self._clock() + self.timeout_s
            if self.skip_drain:
                self.abandoned.set()

    @property
    def begun(self) -> bool:
        return self._deadline is not None

    def remaining(self) -> float:
        """Seconds left to upload before exiting (starting the deadline if nothing did yet)."""
        self.begin()
        if self.abandoned.is_set():
            return 0.0
        assert self._deadline is not None
        return max(0.0, self._deadline - self._clock())

    async def bounded(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None if the deadline passed or the stop was abandoned first."""
        task = asyncio.ensure_future(work)
        abandon = asyncio.ensure_future(self.abandoned.wait())
        try:
            done, _ = await asyncio.wait({task, abandon}, timeout=self.remaining(),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            abandon.cancel()
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    # -- what the daemon wires ----------------------------------------------------------------------
    def signalled(self, name: str, end_session: Callable[[], None]) -> None:
        """A SIGTERM/SIGINT: the first drains while serving, then ends the session; the second ends
        it at once and abandons every wait."""
        self.signals += 1
        if self.signals > 1:
            log.warning("%s again: stopping now; what is not in the object store stays journaled for the next "
                        "mount", name)
            self.abandoned.set()
            if not self._session_ended:
                end_session()
            return
        self.begin()
        if self._session_ended:
            # Unmounted already (systemd stopping a mount unit signals what is left of it): the upload
            # goes on within the same deadline; a second signal still stops it.
            log.info("%s: still uploading what is pending (at most %.0f s more; send it again to stop now)",
                     name, self.remaining())
            return
        if not self._drains or self.skip_drain:
            end_session()
            return
        log.info("%s: uploading what is pending before unmounting (at most %g s; send it again to stop now)",
                 name, self.timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._drain_then(end_session))

    async def _drain_then(self, end_session: Callable[[], None]) -> None:
        try:
            for drain in self._drains:
                await drain()
        except Exception:  # noqa: BLE001 - a failed drain must still end the session
            log.exception("draining before the stop failed")
        finally:
            end_session()

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def add_routes(self, control: ControlServer) -> None:
        """``POST /stop {"drain": false}``: the next stop uploads nothing (``cachefs unmount --force``);
        ``{"drain": true}`` undoes it (an unmount that then failed)."""

        async def route(params: dict[str, Any]) -> dict[str, Any]:
            drain = params.get("drain")
            if not isinstance(drain, bool):
                raise ControlRequestError(400, "drain must be true or false")
            self.skip_drain = not drain
            if self.skip_drain and self.begun:
                self.abandoned.set()
            return {"ok": True, "drain": drain, "stop_timeout_s": self.timeout_s}

        control.add_json_route("POST", "/stop", route)
