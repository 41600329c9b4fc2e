"""Blocks in flight: counted against the RAM tier, so the RAM tier bounds the daemon's block memory.

Why. A load receives its block into a new buffer (a GET, a cluster hit, a disk-tier read) before the
block is in RAM, and a fetched block stays alive until it is on disk, which may be after the RAM tier
evicted it. Those buffers used to be outside the RAM tier's accounting: up to
``max_concurrent_fetches`` blocks (16 x 8 MiB = 128 MiB by default) beyond ``--ram-cache``. Measured
on a cold 1 GiB read with a 512 MiB RAM tier (``benchmarks.dataplane``): the daemon's peak RSS was
666-698 MiB, its RSS at rest 81 MiB, so 75-105 MiB of blocks were in flight outside the tier.

How. ``InFlight.reserve(n)`` is awaited by a load before it makes a buffer of ``n`` bytes; it grants
the bytes once the reserved total stays within ``limit_bytes`` (half the RAM tier), and on grant the
RAM tier counts them as used (``RamTier.reserve``), evicting held blocks to make room at once. The
load hands its reservation to the RAM tier when it puts its block there (``Reservation.release``
just before ``put``: from then on the tier counts the block itself), or gives it back when the block
never reaches RAM (a warm load, after its disk write). So the RAM tier's capacity bounds held blocks
and blocks in flight together, and the daemon's block memory is ``--ram-cache`` plus the buffer
pool's idle ones (``tiering.buffers.IDLE_BUFFERS``).

Why half the tier: blocks in flight evict held ones, and a tier taken entirely by reservations would
evict read-ahead blocks before they are read. With the default 1 GiB tier the limit (512 MiB) is
far above the fetch slots' 128 MiB, so nothing waits; a small tier (64 MiB: 4 blocks of 8 MiB in
flight) trades parallel fetches for the memory bound it was given. One reservation is always granted
when nothing is reserved, whatever its size, so a block larger than the limit still loads.

Grants are in arrival order (a small block does not overtake a large one waiting), and a reservation
whose waiter is cancelled is never granted. Everything here runs on the event loop (no lock).
``waits`` counts reservations that had to wait; ``reserved_bytes`` is the total granted now.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol, runtime_checkable


@runtime_checkable
class ReservingTier(Protocol):
    """What ``InFlight`` needs of the RAM tier (``tiering.tiers.ram.RamTier``)."""

    capacity_bytes: int

    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` as used from now on, evicting held blocks to make room."""

    def unreserve(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` reserved earlier."""


class Reservation:
    """Bytes granted to one load; ``release`` (idempotent) gives them back."""

    __slots__ = ("_owner", "nbytes")

    def __init__(self, owner: InFlight | None, nbytes: int) -> None:
        self._owner = owner
        self.nbytes = nbytes

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._release(self.nbytes)


class InFlight:
    """The bytes of blocks in flight, bounded by ``limit_bytes`` and counted by the RAM tier.

    ``tier`` None, or a tier of capacity 0 (disabled): nothing is counted and nothing waits (the
    fetch slots alone bound what is in flight).
    """

    def __init__(self, tier: ReservingTier | None) -> None:
        self._tier = tier if tier is not None and tier.capacity_bytes > 0 else None
        self.limit_bytes = self._tier.capacity_bytes // 2 if self._tier is not None else 0
        self.reserved_bytes = 0
        self.waits = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, nbytes: int) -> bool:
        return self.reserved_bytes == 0 or self.reserved_bytes + nbytes <= self.limit_bytes

    def _grant(self, nbytes: int) -> None:
        assert self._tier is not None
        self.reserved_bytes += nbytes
        self._tier.reserve(nbytes)

    async def reserve(self, nbytes: int) -> Reservation:
        """Wait until ``nbytes`` more fit within the limit (in arrival order), then hold them."""
        if self._tier is None:
            return Reservation(None, nbytes)
        if not self._waiters and self._fits(nbytes):
            self._grant(nbytes)
            return Reservation(self, nbytes)
        self.waits += 1
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release(nbytes)  # granted, then cancelled before it could be used
            else:
                if entry in self._waiters:
                    self._waiters.remove(entry)
                self._wake()  # those behind it may fit now
            raise
        return Reservation(self, nbytes)

    def _release(self, nbytes: int) -> None:
        assert self._tier is not None
        self.reserved_bytes -= nbytes
        self._tier.unreserve(nbytes)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            nbytes, waiter = self._waiters[0]
            if waiter.done():  # cancelled, its task not yet resumed: never granted
                self._waiters.popleft()
                continue
            if not self._fits(nbytes):
                return
            self._waiters.popleft()
            self._grant(nbytes)
            waiter.set_result(None)
