"""The cluster key (tiering.clusterkey) and the cluster tier's authenticated frame (tiering.tiers.clusterframe)."""

from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path

import blake3
import pytest

from tests.support.clusterkeys import OTHER_KEY, TEST_KEY, TEST_SECRET, write_key_file
from tiering.buffers import MAP_MIN_BYTES
from tiering.clusterkey import JOURNAL, KEY_MIN_BYTES, ClusterKey, ClusterKeyError
from tiering.tiers.blockformat import CorruptBlockError, frame_header
from tiering.tiers.clusterframe import (
    MAGIC_HMAC,
    ForgedFrameError,
    FrameKeys,
    StaleFrameError,
    decode_frame,
    encode_frame,
    frame_size,
)

TOKEN = b's3://b/\x0065536\x00k\x00"e"\x000'
MAC = FrameKeys.of(TEST_KEY)

# The frame of b"hello" under TOKEN and the test key: magic "CFS3", layout 1 (packed), token length
# 21, data length 5, the token, the 32-byte keyed BLAKE3, the data. Pinned: a change here is a new format.
GOLDEN = bytes.fromhex(
    "43465333" "0100" "15000000" "0500000000000000"
    "73333a2f2f622f003635353336006b0022652200" "30"
    "9b250766fa48fb3128f7acb8320abf551a9158703cf9c827579186093ee950f9"
    "68656c6c6f"
)
# The same block in the previous release's frame (magic "CFSA", HMAC-SHA256): still read, never written.
GOLDEN_HMAC = bytes.fromhex(
    "43465341" "0100" "15000000" "0500000000000000"
    "73333a2f2f622f003635353336006b0022652200" "30"
    "8b6252c9308b838cd12fb95e4fa6e6ca28609e2663074bc7ce0abd209c9f3ed8"
    "68656c6c6f"
)


def _blocks_key(purpose: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) of the test secret for one purpose, by hand."""
    prk = hmac.new(b"cachefs cluster key v1", TEST_SECRET, hashlib.sha256).digest()
    return hmac.new(prk, purpose + b"\x01", hashlib.sha256).digest()


def test_golden_bytes_of_a_packed_frame() -> None:
    assert encode_frame(MAC, TOKEN, b"hello") == GOLDEN
    assert bytes(decode_frame(MAC, GOLDEN, TOKEN)) == b"hello"
    assert frame_size(TOKEN, 5) == len(GOLDEN)


def test_the_mac_is_hkdf_then_keyed_blake3_over_header_and_data() -> None:
    """Computed here from RFC 5869 and the BLAKE3 library by hand, not through the module: the format
    is what docs/tiers.md says, readable by any implementation holding the key."""
    head = struct.pack("<4sHIQ", b"CFS3", 1, len(TOKEN), 5) + TOKEN
    tag = blake3.blake3(head + b"hello", key=_blocks_key(b"cluster blocks v2 blake3")).digest()
    assert GOLDEN[len(head):len(head) + 32] == tag


def test_the_previous_releases_hmac_frames_are_still_read_never_written() -> None:
    """A cluster store filled before the upgrade stays warm: its HMAC-SHA256 frames are authentic."""
    head = struct.pack("<4sHIQ", b"CFSA", 1, len(TOKEN), 5) + TOKEN
    tag = hmac.new(_blocks_key(b"cluster blocks v1"), head + b"hello", hashlib.sha256).digest()
    assert GOLDEN_HMAC[len(head):len(head) + 32] == tag
    assert bytes(decode_frame(MAC, GOLDEN_HMAC, TOKEN)) == b"hello"
    assert encode_frame(MAC, TOKEN, b"hello", magic=MAGIC_HMAC) == GOLDEN_HMAC
    assert encode_frame(MAC, TOKEN, b"hello")[:4] == b"CFS3"
    forged = encode_frame(FrameKeys.of(OTHER_KEY), TOKEN, b"hello", magic=MAGIC_HMAC)
    with pytest.raises(ForgedFrameError):
        decode_frame(MAC, forged, TOKEN)
    # The magic picks the key: an HMAC frame relabelled CFS3 (or the reverse) fails its MAC.
    with pytest.raises(ForgedFrameError):
        decode_frame(MAC, b"CFS3" + GOLDEN_HMAC[4:], TOKEN)
    with pytest.raises(ForgedFrameError):
        decode_frame(MAC, b"CFSA" + GOLDEN[4:], TOKEN)


def test_a_large_block_is_aligned_and_round_trips() -> None:
    data = bytes(range(256)) * (MAP_MIN_BYTES // 256)
    blob = encode_frame(MAC, TOKEN, data)
    assert blob[4:6] == b"\x02\x00" and (len(blob) - len(data)) % 4096 == 0
    assert len(blob) == frame_size(TOKEN, len(data))
    assert bytes(decode_frame(MAC, blob, TOKEN)) == data


@pytest.mark.parametrize("where", ["magic", "layout", "length", "token", "mac", "data", "truncated", "longer"])
def test_every_damage_is_refused(where: str) -> None:
    blob = bytearray(GOLDEN)
    if where == "magic":
        blob[0] ^= 1
    elif where == "layout":
        blob[4] = 9
    elif where == "length":
        blob[10] = 4
    elif where == "token":
        blob[20] ^= 1
    elif where == "mac":
        blob[45] ^= 1
    elif where == "data":
        blob[-1] ^= 1
    elif where == "truncated":
        del blob[-1]
    else:
        blob += b"x"
    with pytest.raises(CorruptBlockError):
        decode_frame(MAC, bytes(blob), TOKEN)


def test_a_frame_under_another_key_or_purpose_is_a_forgery() -> None:
    forged = encode_frame(FrameKeys.of(OTHER_KEY), TOKEN, b"hello")
    assert len(forged) == len(GOLDEN) and forged[:-37] == GOLDEN[:-37]  # all but the MAC (and data) alike
    with pytest.raises(ForgedFrameError):
        decode_frame(MAC, forged, TOKEN)
    journal = FrameKeys(TEST_KEY.derive_blake3(JOURNAL), TEST_KEY.derive(JOURNAL))
    for magic in (b"CFS3", MAGIC_HMAC):  # a journal key's MAC is no block's MAC
        with pytest.raises(ForgedFrameError):
            decode_frame(MAC, encode_frame(journal, TOKEN, b"hello", magic=magic), TOKEN)


def test_a_frame_of_another_block_is_refused_even_with_a_valid_mac() -> None:
    other = encode_frame(MAC, TOKEN[:-1] + b"1", b"hello")  # block 1, validly written
    with pytest.raises(CorruptBlockError, match="another block"):
        decode_frame(MAC, other, TOKEN)


def test_the_previous_format_is_stale_not_forged() -> None:
    old = frame_header(TOKEN, b"hello") + b"hello"
    with pytest.raises(StaleFrameError):
        decode_frame(MAC, old, TOKEN)


def test_key_file(tmp_path: Path) -> None:
    path = write_key_file(tmp_path)
    assert ClusterKey.from_file(path).fingerprint() == TEST_KEY.fingerprint()
    text = tmp_path / "hex.key"
    text.write_text("ab" * 32 + "\n")  # `openssl rand -hex 32 > FILE`: the newline is not part of it
    assert ClusterKey.from_file(text).fingerprint() == ClusterKey(b"ab" * 32).fingerprint()
    crlf = tmp_path / "crlf.key"
    crlf.write_bytes(b"ab" * 32 + b"\r\n")
    assert ClusterKey.from_file(crlf).fingerprint() == ClusterKey(b"ab" * 32).fingerprint()
    # `head -c 32 /dev/urandom > FILE`: random bytes are the key whole, a last byte of '\n' included
    # (it was dropped, leaving 31 bytes: refused, one random key in 256; found by the bench smoke test).
    binary = tmp_path / "random.key"
    binary.write_bytes(bytes(range(200, 231)) + b"\n")
    assert ClusterKey.from_file(binary).fingerprint() == ClusterKey(bytes(range(200, 231)) + b"\n").fingerprint()
    assert TEST_KEY.fingerprint() != OTHER_KEY.fingerprint()
    assert "secret" in repr(MAC.hmac) and "secret" in repr(MAC.blake3) and TEST_SECRET.hex() not in repr(TEST_KEY)


@pytest.mark.parametrize("content", [None, b"", b"short\n", b"x" * 5000])
def test_a_bad_key_file_is_one_line_naming_it(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "cluster.key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ClusterKeyError) as info:
        ClusterKey.from_file(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    if content is not None and len(content) < KEY_MIN_BYTES:
        assert f"at least {KEY_MIN_BYTES}" in message
