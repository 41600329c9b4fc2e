"""The block format: one cached block as a header (its identity and checksums) followed by its data.

The disk tier writes it as one file per block, the cluster tier as one object per block; both read
it back through ``check_*``/``decode_block``, so a block is checked the same way wherever it was.

File format, all integers little-endian::

    offset        size  field
    0             4     magic  b"CFSB"
    4             2     format version (u16): 1 (packed) or 2 (aligned)
    6             4     token length T (u32), in bytes
    10            8     data length D (u64)
    18            4     CRC-32 of the data (u32, zlib polynomial)
    22            T     key token: BlockKey.token() encoded utf-8 with surrogateescape
    22+T          4     CRC-32 of bytes [0, 22+T) (u32): the header checks itself
    26+T          P     version 2 only: zero bytes up to the next multiple of 4 KiB (``DIRECT_ALIGN``)
    26+T+P        D     data

Version 2 (aligned) is written for blocks of ``ALIGNED_MIN_BYTES`` (1 MiB) and more, version 1
(packed) below that; readers take both. The padding puts the data on a 4 KiB boundary of the file
(and of a buffer the whole object is received into), which is what lets the disk tier write and read
large blocks with ``O_DIRECT``, straight between the block's page-aligned buffer and the device, with
no copy into the page cache (``tiering.tiers.blockfile`` has the figures). 4 KiB per 8 MiB block is 0.05%; a
small block keeps the packed layout, where the padding would be a visible share.

The fixed part is ``HEADER_FORMAT`` below; a golden-bytes test (tests/unit/test_disk_tier.py) pins
it. A reader checks, in order: magic, version, that the token length and then the token equal the
requested key's (a file or object name is only a hash: a collision, a stray copy or an old block
under the same name must never be returned), the header CRC, that the length agrees with the header,
and the data CRC. Any failed check raises ``CorruptBlockError``, which each tier turns into a miss.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from tiering.blocks import BlockData, BlockKey
from tiering.buffers import MAP_MIN_BYTES, align_up
from tiering.checksum import crc32

MAGIC = b"CFSB"
FORMAT_VERSION = 1  # packed: the data right after the header
ALIGNED_VERSION = 2  # aligned: the data at the next multiple of DIRECT_ALIGN
# Blocks of this size and more are written aligned: the same bound as pooled (page-aligned) buffers.
ALIGNED_MIN_BYTES = MAP_MIN_BYTES
# magic, format version, token length, data length, data CRC-32. Little-endian, no padding.
HEADER_FORMAT = "<4sHIQI"
_FIXED = struct.Struct(HEADER_FORMAT)
# CRC-32 of the fixed part plus the token, right after the token.
_HEADER_CRC = struct.Struct("<I")
FIXED_HEADER_SIZE = _FIXED.size
HEADER_CRC_SIZE = _HEADER_CRC.size


class CorruptBlockError(Exception):
    """A block file failed a check. Internal: turned into a miss, never raised to a caller."""


def encode_token(key: BlockKey) -> bytes:
    """The key token as written into a block header."""
    return key.token().encode("utf-8", "surrogateescape")


def encode_header(key: BlockKey, data: BlockData) -> bytes:
    """The header of the block file holding ``data`` for ``key`` (see the module docstring)."""
    return frame_header(encode_token(key), data)


def frame_header(token: bytes, data: BlockData | memoryview) -> bytes:
    """The header framing ``data`` under the identity ``token``, padding included: the data follows
    it directly (format in the module docstring)."""
    version = _version_for(len(data))
    fixed = _FIXED.pack(MAGIC, version, len(token), len(data), crc32(data))
    header = fixed + token + _HEADER_CRC.pack(crc32(token, crc32(fixed)))
    return header + bytes(_offset(version, len(token)) - len(header))


def _version_for(data_len: int) -> int:
    """The format a block of ``data_len`` bytes is written in now."""
    return ALIGNED_VERSION if data_len >= ALIGNED_MIN_BYTES else FORMAT_VERSION


def data_offset(token_len: int, data_len: int) -> int:
    """Where the data of a block of ``data_len`` bytes starts, in a block written now."""
    return _offset(_version_for(data_len), token_len)


def packed_offset(token_len: int) -> int:
    """Where the data of a packed block (format version 1) starts: right after its header."""
    return _offset(FORMAT_VERSION, token_len)


def _offset(version: int, token_len: int) -> int:
    head = _FIXED.size + token_len + _HEADER_CRC.size
    return align_up(head) if version == ALIGNED_VERSION else head


def header_size(token: bytes, data_len: int) -> int:
    """Bytes before the data (header and padding) of a block of ``data_len`` bytes for ``token``."""
    return data_offset(len(token), data_len)


class FixedHeader(NamedTuple):
    data_len: int
    data_crc: int
    data_offset: int  # where the data starts: the header, its CRC and any padding come before


def check_fixed_header(fixed: bytes | memoryview, token: bytes) -> FixedHeader:
    """Check the fixed part of a header against the expected ``token``.

    Raises ``CorruptBlockError`` (truncated, bad magic, an unknown format version, another token length).
    """
    if len(fixed) != _FIXED.size:
        raise CorruptBlockError("truncated header")
    magic, version, token_len, data_len, data_crc = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version not in (FORMAT_VERSION, ALIGNED_VERSION):
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION} or {ALIGNED_VERSION}")
    if token_len != len(token):
        raise CorruptBlockError("key token length differs from the requested key's")
    return FixedHeader(data_len, data_crc, _offset(version, token_len))


# A token longer than this is not one a reader asks for (an object key is at most 1 KiB in S3):
# a scan that finds such a length is looking at something other than a header.
MAX_TOKEN_BYTES = 64 * 1024


def header_fields(fixed: bytes | memoryview) -> tuple[int, int, int] | None:
    """``(token length, data length, data offset)`` of a fixed header read where no token is known
    yet (a start-up scan of packs, ``tiering.tiers.packs``), or None if it is not one: bad magic, an
    unknown version, a token length no key has. The token and the header CRC are checked after, with
    ``check_header_token`` against the token read from the header itself."""
    if len(fixed) != _FIXED.size:
        return None
    magic, version, token_len, data_len, _data_crc = _FIXED.unpack(fixed)
    if magic != MAGIC or version not in (FORMAT_VERSION, ALIGNED_VERSION) or not 0 < token_len <= MAX_TOKEN_BYTES:
        return None
    return token_len, data_len, _offset(version, token_len)


def check_header_token(fixed: bytes | memoryview, rest: bytes | memoryview, token: bytes) -> None:
    """Check the token and header CRC after the fixed part (``rest``: token plus CRC, then the padding
    of an aligned block, which must be zeros: a header is all checked or it is not a header)."""
    if len(rest) < len(token) + _HEADER_CRC.size:
        raise CorruptBlockError("truncated header")
    stored_token = bytes(rest[: len(token)])
    (header_crc,) = _HEADER_CRC.unpack_from(rest, len(token))
    if crc32(stored_token, crc32(fixed)) != header_crc:
        raise CorruptBlockError("header checksum mismatch")
    if stored_token != token:
        raise CorruptBlockError("block belongs to another key")
    padding = rest[len(token) + _HEADER_CRC.size:]
    if padding and bytes(padding).count(0) != len(padding):
        raise CorruptBlockError("header padding is not zeros")


def check_data(data: BlockData, data_len: int, data_crc: int) -> None:
    if len(data) != data_len:
        raise CorruptBlockError("truncated data")
    if crc32(data) != data_crc:
        raise CorruptBlockError("data checksum mismatch")


def decode_block(blob: BlockData, token: bytes) -> BlockData:
    """The data of a framed block held whole in memory (an object of the cluster tier), checked as a
    block file is; ``CorruptBlockError`` on any failed check. The data is a view of ``blob``, not a
    copy."""
    fixed = bytes(blob[: _FIXED.size])
    data_len, data_crc, head = check_fixed_header(fixed, token)
    check_header_token(fixed, blob[_FIXED.size : head], token)
    if len(blob) != head + data_len:
        raise CorruptBlockError(f"block is {len(blob)} bytes, header says {head + data_len}")
    data = memoryview(blob)[head:].toreadonly()
    check_data(data, data_len, data_crc)
    return data


def block_file_size(key: BlockKey, data_len: int) -> int:
    """Bytes on disk of the file holding ``data_len`` bytes of ``key``: what capacity counts."""
    return data_offset(len(encode_token(key)), data_len) + data_len


def object_footprint(key: str, etag: str, size: int, block_size: int) -> int:
    """Bytes on disk of every block of one object version: data plus one header (and padding) per block.

    Closed form of ``sum(block_file_size(BlockKey(key, etag, i), len_i))`` over the blocks (the
    token holds the decimal block index, so header sizes grow by a byte per power of ten; the last
    block may be short enough to be packed where the others are aligned).
    """
    blocks = (size + block_size - 1) // block_size
    base = len(encode_token(BlockKey(key, etag, 0))) - 1  # the token without its one-digit index
    last_len = size - (blocks - 1) * block_size
    total, width, start = size, 1, 0
    while start < blocks:
        stop = min(blocks, 10**width)
        token_len = base + width
        full = stop - start - (1 if stop == blocks else 0)
        total += full * data_offset(token_len, block_size)
        if stop == blocks:
            total += data_offset(token_len, last_len)
        start, width = stop, width + 1
    return total
