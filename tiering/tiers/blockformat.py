"""The block format: one cached block as a header (its identity and checksums) followed by its data.

The disk tier writes it as one file per block, the cluster tier as one object per block; both read
it back through ``check_*``/``decode_block``, so a block is checked the same way wherever it was.

File format (version 1), all integers little-endian::

    offset        size  field
    0             4     magic  b"CFSB"
    4             2     format version (u16) = 1
    6             4     token length T (u32), in bytes
    10            8     data length D (u64)
    18            4     CRC-32 of the data (u32, zlib polynomial)
    22            T     key token: BlockKey.token() encoded utf-8 with surrogateescape
    22+T          4     CRC-32 of bytes [0, 22+T) (u32): the header checks itself
    26+T          D     data

The fixed part is ``HEADER_FORMAT`` below; a golden-bytes test (tests/unit/test_disk_tier.py) pins
it. A reader checks, in order: magic, version, that the token length and then the token equal the
requested key's (a file or object name is only a hash: a collision, a stray copy or an old block
under the same name must never be returned), the header CRC, that the length agrees with the header,
and the data CRC. Any failed check raises ``CorruptBlockError``, which each tier turns into a miss.
"""

from __future__ import annotations

import struct

from tiering.blocks import BlockData, BlockKey
from tiering.checksum import crc32

MAGIC = b"CFSB"
FORMAT_VERSION = 1
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
    """The header framing ``data`` under the identity ``token`` (format in the module docstring)."""
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(token), len(data), crc32(data))
    return fixed + token + _HEADER_CRC.pack(crc32(token, crc32(fixed)))


def header_size(token: bytes) -> int:
    """Bytes of the header for ``token``."""
    return _FIXED.size + len(token) + _HEADER_CRC.size


def check_fixed_header(fixed: bytes, token: bytes) -> tuple[int, int]:
    """Check the fixed part of a header against the expected ``token``: ``(data length, data CRC)``.

    Raises ``CorruptBlockError`` (truncated, bad magic, another format version, another token length).
    """
    if len(fixed) != _FIXED.size:
        raise CorruptBlockError("truncated header")
    magic, version, token_len, data_len, data_crc = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, expected {FORMAT_VERSION}")
    if token_len != len(token):
        raise CorruptBlockError("key token length differs from the requested key's")
    return data_len, data_crc


def check_header_token(fixed: bytes, rest: bytes, token: bytes) -> None:
    """Check the token and header CRC after the fixed part (``rest``: token plus CRC)."""
    if len(rest) != len(token) + _HEADER_CRC.size:
        raise CorruptBlockError("truncated header")
    stored_token = rest[: len(token)]
    (header_crc,) = _HEADER_CRC.unpack_from(rest, len(token))
    if crc32(stored_token, crc32(fixed)) != header_crc:
        raise CorruptBlockError("header checksum mismatch")
    if stored_token != token:
        raise CorruptBlockError("block belongs to another key")


def check_data(data: BlockData, data_len: int, data_crc: int) -> None:
    if len(data) != data_len:
        raise CorruptBlockError("truncated data")
    if crc32(data) != data_crc:
        raise CorruptBlockError("data checksum mismatch")


def decode_block(blob: BlockData, token: bytes) -> BlockData:
    """The data of a framed block held whole in memory (an object of the cluster tier), checked as a
    block file is; ``CorruptBlockError`` on any failed check. The data is a view of ``blob``, not a
    copy."""
    head = header_size(token)
    fixed = bytes(blob[: _FIXED.size])
    data_len, data_crc = check_fixed_header(fixed, token)
    check_header_token(fixed, bytes(blob[_FIXED.size : head]), token)
    if len(blob) != head + data_len:
        raise CorruptBlockError(f"block is {len(blob)} bytes, header says {head + data_len}")
    data = memoryview(blob)[head:].toreadonly()
    check_data(data, data_len, data_crc)
    return data


def block_file_size(key: BlockKey, data_len: int) -> int:
    """Bytes on disk of the file holding ``data_len`` bytes of ``key``: what capacity counts."""
    return _FIXED.size + len(encode_token(key)) + _HEADER_CRC.size + data_len


def object_footprint(key: str, etag: str, size: int, block_size: int) -> int:
    """Bytes on disk of every block of one object version: data plus one header per block.

    Closed form of ``sum(block_file_size(BlockKey(key, etag, i), len_i))`` over the blocks (the
    token holds the decimal block index, so header sizes grow by a byte per power of ten).
    """
    blocks = (size + block_size - 1) // block_size
    fixed = FIXED_HEADER_SIZE + HEADER_CRC_SIZE + len(encode_token(BlockKey(key, etag, 0))) - 1
    digits, width, start = 0, 1, 0
    while start < blocks:
        stop = min(blocks, 10**width)
        digits += (stop - start) * width
        start, width = stop, width + 1
    return size + blocks * fixed + digits
