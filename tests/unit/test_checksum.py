"""The CRC-32 cachefs writes into its on-disk formats is zlib's, whichever implementation computes it."""

import zlib

from hypothesis import given
from hypothesis import strategies as st

from tiering.checksum import crc32


@given(st.binary(max_size=4096), st.binary(max_size=4096), st.integers(min_value=0, max_value=2**32 - 1))
def test_crc32_equals_zlib_and_chains_like_it(first: bytes, second: bytes, seed: int) -> None:
    assert crc32(first) == zlib.crc32(first)
    assert crc32(second, crc32(first)) == zlib.crc32(first + second)
    assert crc32(first, seed) == zlib.crc32(first, seed)


def test_crc32_of_large_buffers_and_views() -> None:
    data = bytes(range(256)) * 40_000  # 10 MB: the sizes of cache blocks, not just small inputs
    assert crc32(data) == zlib.crc32(data)
    view = memoryview(data)[12_345:9_000_000]
    assert crc32(view) == zlib.crc32(view)
    assert crc32(bytearray(data[:1000])) == zlib.crc32(data[:1000])
