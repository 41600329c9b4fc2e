"""``InMemoryBudget``: the ``SpaceBudget`` double (a counter), for tests and anything without a disk tier."""

from __future__ import annotations

import threading


class InMemoryBudget:
    """A fixed number of bytes; nothing to evict. ``reserve_space`` fails once they are taken."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity must not be negative")
        self.capacity_bytes = capacity_bytes
        self._used = 0
        self._lock = threading.Lock()

    def reserve_space(self, nbytes: int, *, force: bool = False) -> bool:
        with self._lock:
            if force or self._used + nbytes <= self.capacity_bytes:
                self._used += nbytes
                return True
            return False

    def release_space(self, nbytes: int) -> None:
        with self._lock:
            if nbytes > self._used:
                raise AssertionError(f"releasing {nbytes} bytes, only {self._used} reserved")
            self._used -= nbytes

    def reserved_space(self) -> int:
        return self._used
