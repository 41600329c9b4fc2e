"""The disk tier beyond the common contract: on-disk format, corruption, restart, failing disks."""

from __future__ import annotations

import errno
import functools
import os
import random
import shutil
import struct
import threading
import zlib
from pathlib import Path

import pytest

import tiering.tiers.blockfile as blockfile_module
import tiering.tiers.disk as disk_module
from tiering.blocks import BlockKey
from tiering.clock import FakeClock
from tiering.tiers.disk import DiskTier as _DiskTier, block_file_size, check_cache_dir
from tiering.health import TierState

# Tests of block files: small blocks as files of their own here (tests/unit/test_disk_packs.py has them
# as records of pack files, the default).
DiskTier = functools.partial(_DiskTier, pack_small=False)

GOLDEN_KEY = BlockKey("datasets/imagenet/train-00042.tar", '"9b2cf535f27731c974343645a3985328"', 7)
GOLDEN_DATA = bytes(range(256)) * 2
# The 96-byte header of GOLDEN_KEY/GOLDEN_DATA, as format version 1 writes it. If this changes, the
# on-disk format changed: bump FORMAT_VERSION and say so, do not just update the constant.
GOLDEN_HEADER_HEX = (
    "4346534201004600000000020000000000007635611c3700223962326366353335663237373331633937343334"
    "333634356133393835333238220064617461736574732f696d6167656e65742f747261696e2d30303034322e74"
    "617226650012"
)


def key(i: int, etag: str = "e1") -> BlockKey:
    return BlockKey("bucket/object", etag, i)


def data_of(i: int, n: int = 1000) -> bytes:
    return bytes([i % 256]) * n


FOOT = block_file_size(key(0), 1000)  # footprint of one test block (single-digit indexes)


def block_path(directory: Path, k: BlockKey) -> Path:
    d = k.digest()
    return directory / "blocks" / d[:2] / f"{d}.blk"


def files_under(directory: Path, suffix: str) -> list[Path]:
    return sorted(p for p in (directory / "blocks").rglob("*") if p.is_file() and p.name.endswith(suffix))


# -- format ---------------------------------------------------------------------------------------


def test_golden_bytes_pin_the_file_format(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(GOLDEN_KEY, GOLDEN_DATA)

    token = b'7\x00"9b2cf535f27731c974343645a3985328"\x00datasets/imagenet/train-00042.tar'
    fixed = b"CFSB" + struct.pack("<H", 1) + struct.pack("<I", len(token))
    fixed += struct.pack("<Q", len(GOLDEN_DATA)) + struct.pack("<I", zlib.crc32(GOLDEN_DATA))
    header = fixed + token + struct.pack("<I", zlib.crc32(fixed + token))
    written = block_path(tmp_path, GOLDEN_KEY).read_bytes()

    assert written == header + GOLDEN_DATA
    assert written[: len(header)].hex() == GOLDEN_HEADER_HEX
    assert tier.used_bytes() == len(written) == block_file_size(GOLDEN_KEY, len(GOLDEN_DATA))
    assert files_under(tmp_path, ".tmp") == []


def test_non_utf8_keys_roundtrip(tmp_path: Path) -> None:
    k = BlockKey("odd/name-\udcff", "e1", 0)  # an undecodable byte kept by surrogateescape
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(k, b"x")
    assert DiskTier(tmp_path, 10**6).get(k) == b"x"


# -- corruption -----------------------------------------------------------------------------------


def flip(offset: int):
    def damage(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x01
        path.write_bytes(bytes(raw))

    return damage


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)


def extend(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"junk")


def swap_in_other_key(path: Path) -> None:
    """A valid block of another key under this key's name (a hash collision, a stray copy)."""
    other = BlockKey("bucket/object", "e1", 1)
    path.write_bytes(disk_module.encode_header(other, data_of(0)) + data_of(0))


def other_token_same_length(path: Path) -> None:
    """A valid block whose token has the same length but another ETag."""
    other = BlockKey("bucket/object", "e2", 0)
    path.write_bytes(disk_module.encode_header(other, data_of(0)) + data_of(0))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(flip(-1), id="data-byte"),
        pytest.param(flip(0), id="magic"),
        pytest.param(flip(4), id="version"),
        pytest.param(flip(12), id="data-length"),
        pytest.param(flip(24), id="token-byte"),
        pytest.param(truncate, id="truncated"),
        pytest.param(extend, id="trailing-bytes"),
        pytest.param(lambda p: p.write_bytes(b""), id="empty-file"),
        pytest.param(swap_in_other_key, id="other-key"),
        pytest.param(other_token_same_length, id="other-etag"),
    ],
)
@pytest.mark.parametrize("restart", [False, True], ids=["live", "after-restart"])
@pytest.mark.parametrize("read", ["get", "get_for_reply"])
def test_corrupt_block_is_dropped_and_never_returned(tmp_path: Path, damage, restart: bool, read: str) -> None:
    tier = DiskTier(tmp_path, 10**6)
    k = key(0)
    assert tier.put(k, data_of(0))
    path = block_path(tmp_path, k)
    damage(path)
    if restart:
        tier = DiskTier(tmp_path, 10**6)

    assert getattr(tier, read)(k) is None
    assert tier.stats.corrupt_blocks == 1
    assert tier.stats.errors == 0
    assert not path.exists()
    assert len(tier) == 0 and tier.used_bytes() == 0
    assert tier.health.state is TierState.HEALTHY
    assert tier.put(k, data_of(0))  # re-fetched and stored again
    assert tier.get(k) == data_of(0)


# -- restart --------------------------------------------------------------------------------------


def test_blocks_survive_a_restart(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    for i in range(3):
        assert tier.put(key(i), data_of(i))
    used = tier.used_bytes()

    again = DiskTier(tmp_path, 10 * FOOT)
    assert len(again) == 3 and again.used_bytes() == used
    assert again.keys() == []  # only digests are known until a key is seen
    assert again.contains(key(1))
    assert again.get(key(1)) == data_of(1)
    assert again.keys() == [key(1)]


def test_lru_order_is_rebuilt_from_mtimes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    for i in range(4):
        tier.put(key(i), data_of(i))
    tier.get(key(1))
    tier.get(key(0))
    order = [2, 3, 1, 0]

    # Narrow watermarks: small batches (two blocks), to watch the order as it goes.
    again = DiskTier(tmp_path, 4 * FOOT, high_watermark=1.0, low_watermark=0.99)
    gone: set[int] = set()
    sizes = []
    for i in range(4, 8):
        assert again.put(key(i), data_of(i))
        gone = {j for j in range(4) if not again.contains(key(j))}
        assert gone == set(order[: len(gone)]), "evicted out of LRU order"
        sizes.append(len(gone))
    assert sizes == [2, 2, 4, 4]


def test_lowered_capacity_evicts_at_start(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    for i in range(10):
        tier.put(key(i), data_of(i))
    small = DiskTier(tmp_path, 4 * FOOT)
    assert small.used_bytes() <= 4 * FOOT * small.low_watermark
    assert len(files_under(tmp_path, ".blk")) == len(small)
    survivors = [i for i in range(10) if small.contains(key(i))]
    assert survivors == list(range(10 - len(small), 10)), "the most recent ones stay"
    assert all(small.get(key(i)) == data_of(i) for i in survivors)


def test_leftover_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    tier.put(key(0), data_of(0))
    sub = block_path(tmp_path, key(0)).parent
    (sub / f".{key(0).digest()}.123.0.tmp").write_bytes(b"torn")
    other = tmp_path / "blocks" / "ff"
    other.mkdir(exist_ok=True)
    (other / ".ffff.9.9.tmp").write_bytes(b"torn")
    (other / "README").write_text("not ours")  # unknown files are left alone and not counted

    again = DiskTier(tmp_path, 10 * FOOT)
    assert files_under(tmp_path, ".tmp") == []
    assert (other / "README").exists()
    assert len(again) == 1 and again.used_bytes() == FOOT
    assert again.get(key(0)) == data_of(0)


# -- watermarks -----------------------------------------------------------------------------------


def test_eviction_runs_in_batches_between_watermarks(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 20 * FOOT, high_watermark=0.95, low_watermark=0.85)
    for i in range(19):
        assert tier.put(key(i % 10, f"e{i // 10}"), data_of(i))
    assert tier.stats.evictions == 0 and tier.used_bytes() == 19 * FOOT
    assert tier.put(key(9, "e9"), data_of(99))  # 20 blocks would cross 95%: drop to 85% first
    assert tier.stats.evictions == 3  # 19 -> 16, so that 16 + the new one = 17 = 85%
    assert tier.used_bytes() == 17 * FOOT
    assert tier.keys()[0] == key(3, "e0")  # 0, 1 and 2 of the first ten went, in LRU order
    for i in range(3):
        assert not tier.contains(key(i, "e0"))
    assert tier.put(key(0, "e0"), data_of(0))  # 18 blocks: under the high watermark again
    assert tier.stats.evictions == 3


# -- failing disk ---------------------------------------------------------------------------------


def raiser(err: int):
    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    return fail


def test_failed_write_degrades_and_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    assert tier.put(key(1), data_of(1))
    monkeypatch.setattr(disk_module.os, "replace", raiser(errno.ENOSPC))

    assert not tier.put(key(2), data_of(2))
    assert not tier.put(key(1), data_of(1))  # a replacement that fails loses the old copy too
    assert tier.stats.errors == 2
    assert files_under(tmp_path, ".tmp") == []
    assert files_under(tmp_path, ".blk") == []
    assert len(tier) == 0 and tier.used_bytes() == 0
    assert tier.get(key(1)) is None and tier.get(key(2)) is None


def test_failed_read_is_a_miss_and_drops_the_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    assert tier.put(key(1), data_of(1))
    real_open = blockfile_module.open_private

    def failing_open(path: Path, flags: int) -> int:
        if not flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, flags)

    monkeypatch.setattr(blockfile_module, "open_private", failing_open)
    assert tier.get(key(1)) is None
    assert tier.stats.errors == 1 and tier.stats.misses == 1
    assert tier.health.consecutive_failures == 1
    assert not tier.contains(key(1)) and tier.used_bytes() == 0


def test_a_block_removed_behind_our_back_is_a_plain_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    tier.put(key(1), data_of(1))
    block_path(tmp_path, key(1)).unlink()
    assert tier.get(key(1)) is None
    assert tier.stats.errors == 0 and len(tier) == 0 and tier.used_bytes() == 0


def test_removed_blocks_directory_is_recreated_on_put(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FOOT)
    tier.put(key(1), data_of(1))
    shutil.rmtree(tmp_path / "blocks")
    assert tier.put(key(2), data_of(2))
    assert tier.get(key(2)) == data_of(2)
    assert tier.get(key(1)) is None


def test_health_goes_down_skips_io_and_recovers_after_cooldown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    tier = DiskTier(tmp_path, 100 * FOOT, clock=clock)
    assert tier.put(key(0), data_of(0))
    calls = {"replace": 0}
    real_replace = os.replace

    def failing_replace(*args, **kwargs):
        calls["replace"] += 1
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_module.os, "replace", failing_replace)
    for i in range(1, 3):
        assert not tier.put(key(i), data_of(i))
    assert tier.health.state is TierState.HEALTHY
    assert not tier.put(key(3), data_of(3))
    assert tier.health.state is TierState.UNSTABLE
    assert tier.get(key(0)) == data_of(0)  # unstable is still used; a success resets...
    assert tier.health.state is TierState.HEALTHY
    for i in range(1, 11):
        assert not tier.put(key(i % 10, "x"), data_of(i))
    assert tier.health.state is TierState.DOWN
    assert calls["replace"] == 13

    # Down: skipped without any I/O.
    assert not tier.put(key(5), data_of(5))
    assert tier.get(key(0)) is None
    assert not tier.contains(key(0))
    assert calls["replace"] == 13
    assert tier.stats.errors == 13

    clock.advance(30)
    assert not tier.put(key(5), data_of(5))  # the probe, still failing
    assert calls["replace"] == 14
    assert not tier.put(key(6), data_of(6))  # cool-down restarted: no I/O
    assert calls["replace"] == 14

    monkeypatch.setattr(disk_module.os, "replace", real_replace)
    clock.advance(30)
    assert tier.put(key(5), data_of(5))  # probe succeeds
    assert tier.health.state is TierState.HEALTHY
    assert tier.get(key(5)) == data_of(5)
    assert tier.get(key(0)) == data_of(0)
    assert files_under(tmp_path, ".tmp") == []


# -- configuration --------------------------------------------------------------------------------


def test_check_cache_dir_creates_a_missing_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    check_cache_dir(target)
    assert target.is_dir()
    assert list(target.iterdir()) == []  # the probe is gone


def test_check_cache_dir_refuses_a_path_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "sub"
    with pytest.raises(OSError) as info:
        check_cache_dir(bad)
    message = str(info.value)
    assert str(bad) in message and "\n" not in message
    assert info.value.errno == errno.ENOTDIR
    with pytest.raises(OSError):
        DiskTier(bad, 10**6)


def test_check_cache_dir_refuses_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as info:
        check_cache_dir(tmp_path / "file")
    assert str(tmp_path / "file") in str(info.value) and "not a directory" in str(info.value)
    assert info.value.errno == errno.ENOTDIR


def test_check_cache_dir_reports_an_unwritable_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_module.os, "open", raiser(errno.EACCES))
    with pytest.raises(PermissionError) as info:
        check_cache_dir(tmp_path)
    assert "not writable" in str(info.value) and str(tmp_path) in str(info.value)


@pytest.mark.parametrize(
    "kw",
    [{"capacity_bytes": -1}, {"high_watermark": 0.8, "low_watermark": 0.9}, {"high_watermark": 1.5}],
)
def test_bad_settings_are_refused(tmp_path: Path, kw: dict) -> None:
    args = {"capacity_bytes": 10**6, **kw}
    with pytest.raises(ValueError):
        DiskTier(tmp_path, **args)


# -- threads --------------------------------------------------------------------------------------


def test_concurrent_use_keeps_the_invariants(tmp_path: Path) -> None:
    capacity = 8 * FOOT
    tier = DiskTier(tmp_path, capacity)
    keys = [key(i, f"e{j}") for i in range(10) for j in range(3)]
    errors: list[BaseException] = []
    over: list[int] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                k = rng.choice(keys)
                expected = data_of(hash(k) % 251)
                op = rng.random()
                if op < 0.45:
                    tier.put(k, expected)
                elif op < 0.95:
                    got = tier.get(k)
                    assert got is None or got == expected
                else:
                    tier.discard(k)
                if tier.used_bytes() > capacity:
                    over.append(tier.used_bytes())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == [] and over == []
    on_disk = files_under(tmp_path, ".blk")
    assert files_under(tmp_path, ".tmp") == []
    assert len(on_disk) == len(tier)
    assert sum(p.stat().st_size for p in on_disk) == tier.used_bytes() <= capacity
    assert tier.stats.errors == 0 and tier.stats.corrupt_blocks == 0
