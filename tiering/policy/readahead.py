"""Sequential read-ahead: a pure policy object, one per open file handle.

The window starts at one block on the first sequential read and doubles on every further one, up
to ``max_bytes``; any seek resets it to zero (Mountpoint's policy, with a smaller cap because our
blocks are fetched whole). The kernel's own read-ahead sends requests that are sequential but may
arrive slightly out of order when several are in flight, so a read counts as sequential when it
starts within one block of where the previous read ended.

The policy only says how many bytes beyond the current read to read ahead; the engine decides which
blocks that covers and skips those already cached or in flight. Memory in flight is bounded by the
engine's fetch slots, not here.
"""

from __future__ import annotations


class ReadAhead:
    def __init__(self, block_size: int, max_bytes: int) -> None:
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.window = 0
        self._next_offset: int | None = None

    def on_read(self, offset: int, length: int) -> int:
        """Record a read; return how many bytes past its end to read ahead."""
        sequential = (
            offset == 0 if self._next_offset is None else abs(offset - self._next_offset) <= self.block_size
        )
        if sequential and self.max_bytes > 0:
            self.window = min(max(self.window * 2, self.block_size), self.max_bytes)
        else:
            self.window = 0
        end = offset + length
        self._next_offset = end if self._next_offset is None else max(end, self._next_offset) if sequential else end
        return self.window
