"""CRC-32 (the zlib polynomial) of cache blocks, staged data and journal records.

Every checksum cachefs keeps on disk is this CRC-32, so the formats stay readable by ``zlib.crc32``.
The ISA-L binding computes the same value with carry-less multiplication, about ten times faster
than zlib 1.2's table code on x86-64 (measured: 8 MiB buffers, 17.4 GiB/s against 1.7 GiB/s), which
matters because every block read from or written to the disk tier is checked in full. Where the
``isal`` wheel is not installed (a platform without one), zlib gives the same numbers, slower.
"""

from __future__ import annotations

# crc32(data, value=0), with zlib.crc32's semantics either way.
try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - exercised only where no isal wheel exists
    from zlib import crc32

__all__ = ["crc32"]
