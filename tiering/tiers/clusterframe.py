"""The cluster tier's object format: a block framed with its identity and a MAC under the cluster key.

Why not the disk tier's format (``tiering.tiers.blockformat``). A block file on a node's own disk is
written by that node only, so a CRC-32 catching accidents is enough there. An object of the cluster
store is read by every node of every volume sharing the store and could have been put there by
anyone holding the store's credentials: its CRC-32 and its clear identity prove nothing, since a
forger computes both. So the cluster frame replaces the checksums with a MAC under the blocks key
derived from the cluster key (``tiering.clusterkey``), which only the driver holds: keyed BLAKE3
(magic ``CFS3``), or HMAC-SHA256 in frames written by the previous release (magic ``CFSA``), which
are still read (a cluster store filled before an upgrade stays warm) and never written.

Format, all integers little-endian::

    offset        size  field
    0             4     magic  b"CFS3" (b"CFSA": the previous release's; the disk format's is b"CFSB")
    4             2     layout (u16): 1 (packed) or 2 (aligned), as the disk format's versions
    6             4     token length T (u32), in bytes
    10            8     data length D (u64)
    18            T     token: source identity, block size, object key, ETag, block index
    18+T          32    the MAC of bytes [0, 18+T) followed by the D data bytes: keyed BLAKE3 under
                        the "cluster blocks v2 blake3" key (CFSA: HMAC-SHA256, "cluster blocks v1")
    50+T          P     layout 2 only: zero bytes up to the next multiple of 4 KiB
    50+T+P        D     data

The MAC covers everything that says what the bytes are (the source, the object's key and ETag, the
block's index and size, hence its offset, and the length) and the bytes themselves; the token is
compared with the requested one as well, so a valid frame of another block is still refused. The
padding is checked to be zeros. A reader checks in this order: magic (an object of the previous,
unauthenticated format, magic ``CFSB``, is ``StaleFrameError``: a plain miss the write-behind
overwrites, never an error), layout, token length, token, length, then the MAC (constant-time
compare). Any other failure is ``CorruptBlockError``. A golden-bytes test (tests/unit/
test_cluster_frame.py) pins the format.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from tiering.blocks import BlockData
from tiering.buffers import MAP_MIN_BYTES, align_up
from tiering.clusterkey import BLOCKS, BLOCKS_BLAKE3, MAC_SIZE, Blake3Key, ClusterKey, MacKey
from tiering.tiers.blockformat import MAGIC as DISK_MAGIC
from tiering.tiers.blockformat import CorruptBlockError

MAGIC = b"CFS3"  # keyed BLAKE3: what this release writes
MAGIC_HMAC = b"CFSA"  # HMAC-SHA256: the previous release's frames, read only
PACKED = 1
ALIGNED = 2
# Blocks of this size and more are written aligned, as in the disk format (its module has the reason).
ALIGNED_MIN_BYTES = MAP_MIN_BYTES
HEADER_FORMAT = "<4sHIQ"  # magic, layout, token length, data length
_FIXED = struct.Struct(HEADER_FORMAT)
FIXED_SIZE = _FIXED.size


class StaleFrameError(CorruptBlockError):
    """An object in the previous (unauthenticated) cluster format: a miss, not a forgery."""


class ForgedFrameError(CorruptBlockError):
    """A well-formed frame whose MAC fails: not written with this cluster key."""


@dataclass(frozen=True)
class FrameKeys:
    """The blocks keys of one cluster key: the one frames are written with, and the previous one."""

    blake3: Blake3Key
    hmac: MacKey

    @classmethod
    def of(cls, key: ClusterKey) -> "FrameKeys":
        return cls(key.derive_blake3(BLOCKS_BLAKE3), key.derive(BLOCKS))

    def for_magic(self, magic: bytes) -> Blake3Key | MacKey | None:
        return self.blake3 if magic == MAGIC else self.hmac if magic == MAGIC_HMAC else None


def _layout(data_len: int) -> int:
    return ALIGNED if data_len >= ALIGNED_MIN_BYTES else PACKED


def _offset(layout: int, token_len: int) -> int:
    head = FIXED_SIZE + token_len + MAC_SIZE
    return align_up(head) if layout == ALIGNED else head


def frame_size(token: bytes, data_len: int) -> int:
    """The whole object's size for a block of ``data_len`` bytes: what a read asks for."""
    return _offset(_layout(data_len), len(token)) + data_len


def encode_frame(keys: FrameKeys, token: bytes, data: BlockData | memoryview, *, magic: bytes = MAGIC) -> bytes:
    """The cluster object of ``data`` under ``token``: header, MAC, padding, data (one copy of the
    data; the MAC hashes it with the GIL released: call in a worker thread for large blocks).
    ``magic=MAGIC_HMAC`` writes the previous release's frame (tests of the upgrade only)."""
    mac = keys.for_magic(magic)
    if mac is None:
        raise ValueError(f"no cluster frame format {magic!r}")
    layout = _layout(len(data))
    head = _FIXED.pack(magic, layout, len(token), len(data)) + token
    tag = mac.tag(head, data)
    header = head + tag
    return header + bytes(_offset(layout, len(token)) - len(header)) + data


def decode_frame(keys: FrameKeys, blob: BlockData, token: bytes) -> BlockData:
    """The data of the cluster object ``blob`` for ``token``, a view of ``blob``; raises
    ``StaleFrameError`` (the old format) or ``CorruptBlockError`` (anything else that fails)."""
    if len(blob) < FIXED_SIZE:
        raise CorruptBlockError(f"object is {len(blob)} bytes: truncated header")
    magic, layout, token_len, data_len = _FIXED.unpack_from(blob, 0)
    if magic == DISK_MAGIC:
        raise StaleFrameError("an object of the previous, unauthenticated cluster format")
    mac = keys.for_magic(magic)
    if mac is None:
        raise CorruptBlockError(f"bad magic {bytes(magic)!r}")
    if layout not in (PACKED, ALIGNED):
        raise CorruptBlockError(f"unknown layout {layout}")
    if token_len != len(token):
        raise CorruptBlockError("the token length differs from the requested block's")
    head_end = FIXED_SIZE + token_len
    if len(blob) < head_end + MAC_SIZE:
        raise CorruptBlockError("truncated header")
    view = memoryview(blob)
    if bytes(view[FIXED_SIZE:head_end]) != token:
        raise CorruptBlockError("the object names another block")
    start = _offset(layout, token_len)
    if layout != _layout(data_len):
        raise CorruptBlockError("layout does not fit the data length")
    if len(blob) != start + data_len:
        raise CorruptBlockError(f"object is {len(blob)} bytes, header says {start + data_len}")
    padding = view[head_end + MAC_SIZE:start]
    if padding and bytes(padding).count(0) != len(padding):
        raise CorruptBlockError("header padding is not zeros")
    data = view[start:].toreadonly()
    if not mac.check(view[head_end:head_end + MAC_SIZE], view[:head_end], data):
        raise ForgedFrameError("MAC mismatch: not written with this cluster key")
    return data


__all__ = ["MAGIC", "MAGIC_HMAC", "ForgedFrameError", "FrameKeys", "StaleFrameError", "decode_frame", "encode_frame", "frame_size"]
