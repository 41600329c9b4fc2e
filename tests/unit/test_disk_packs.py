"""Small blocks as records of pack files (tiering.tiers.packs): the layout, a restart, eviction giving
the space back, damage of every kind read as a miss, and what a crash or a failing disk leaves."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from tiering.blocks import BlockKey
from tiering.buffers import DIRECT_ALIGN, align_up
from tiering.tiers.blockformat import ALIGNED_MIN_BYTES, block_file_size, encode_header
from tiering.tiers.disk import DiskTier
from tiering.tiers.packs import PACK_SUFFIX, PackFiles
from tests.support.diskblocks import block_location, flip_byte


def key(i: int, etag: str = "e1") -> BlockKey:
    return BlockKey("bucket/object", etag, i)


def data_of(i: int, n: int = 5000) -> bytes:
    return random.Random(i).randbytes(n)


def packs(directory: Path) -> list[Path]:
    return sorted((directory / "packs").glob(f"*{PACK_SUFFIX}"), key=lambda p: int(p.stem))


def block_files(directory: Path) -> list[Path]:
    return [p for p in (directory / "blocks").rglob("*") if p.is_file()]


def test_a_small_block_is_a_record_of_a_pack_at_a_page_boundary(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    for i in range(3):
        assert tier.put(key(i), data_of(i))
    assert block_files(tmp_path) == []  # no file, no inode per block
    (pack,) = packs(tmp_path)
    raw = pack.read_bytes()
    for i in range(3):
        path, offset, size = block_location(tier, key(i))
        assert path == pack and offset % DIRECT_ALIGN == 0
        assert size == block_file_size(key(i), 5000)  # capacity counts what a block file would hold
        assert raw[offset:offset + size] == encode_header(key(i), data_of(i)) + data_of(i)
    assert tier.used_bytes() == 3 * block_file_size(key(0), 5000)
    assert [tier.get(key(i)) for i in range(3)] == [data_of(i) for i in range(3)]
    assert [bytes(tier.get_for_reply(key(i)) or b"") for i in range(3)] == [data_of(i) for i in range(3)]


def test_a_large_block_stays_a_file(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 64 * 2**20)
    big = data_of(1, ALIGNED_MIN_BYTES)
    assert tier.put(key(0), big)
    assert len(block_files(tmp_path)) == 1 and packs(tmp_path) == []
    assert tier.get(key(0)) == big


def test_records_survive_a_restart_in_the_order_they_were_written(tmp_path: Path) -> None:
    foot = block_file_size(key(0), 5000)
    tier = DiskTier(tmp_path, 10 * foot, high_watermark=1.0, low_watermark=0.99)
    for i in range(5):
        assert tier.put(key(i), data_of(i))
    assert tier.get(key(0)) == data_of(0)  # a hit: not kept across a restart (no mtime per record)
    again = DiskTier(tmp_path, 10 * foot, high_watermark=1.0, low_watermark=0.99)
    assert len(again) == 5 and again.used_bytes() == 5 * foot
    assert [again.get(key(i)) for i in range(5)] == [data_of(i) for i in range(5)]
    # Appends after a restart go to a new pack, named later than every pack found.
    assert again.put(key(9), data_of(9))
    assert [again.places.record(key(i).digest())[0].pack for i in range(5)] == [int(packs(tmp_path)[0].stem)] * 5
    assert again.places.record(key(9).digest())[0].pack == int(packs(tmp_path)[-1].stem) > int(packs(tmp_path)[0].stem)
    # A lowered capacity evicts the oldest written first.
    small = DiskTier(tmp_path, 3 * foot, high_watermark=1.0, low_watermark=0.99)
    assert [small.contains(key(i)) for i in (0, 1, 2, 3, 4, 9)] == [False, False, False, False, True, True]


def test_eviction_punches_the_record_out_and_an_emptied_pack_goes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.packs is not None
    tier.packs.pack_bytes = 4 * align_up(block_file_size(key(0), 50_000))  # four records a pack
    for i in range(8):
        assert tier.put(key(i), data_of(i, 50_000))
    first, second = packs(tmp_path)
    allocated = first.stat().st_blocks
    tier.discard(key(1))
    assert tier.packs.punched == 1
    assert first.stat().st_blocks < allocated  # the record's pages went back to the filesystem
    assert tier.get(key(0)) == data_of(0, 50_000) and tier.get(key(2)) == data_of(2, 50_000)
    for i in (0, 2, 3):
        tier.discard(key(i))
    assert packs(tmp_path) == [second]  # sealed, nothing left in it: unlinked
    again = DiskTier(tmp_path, 10**6)
    assert sorted(k.index for k in (key(i) for i in range(8)) if again.contains(k)) == [4, 5, 6, 7]


def test_a_pack_holding_only_holes_is_removed_at_start_up(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(key(0), data_of(0))
    tier.discard(key(0))  # the active pack: punched, kept for the next append
    assert len(packs(tmp_path)) == 1
    again = DiskTier(tmp_path, 10**6)
    assert len(again) == 0 and packs(tmp_path) == []


@pytest.mark.parametrize("at", [0, 4, 12, 24, -1], ids=["magic", "version", "data-length", "token-byte", "data-byte"])
@pytest.mark.parametrize("restart", [False, True], ids=["live", "after-restart"])
@pytest.mark.parametrize("read", ["get", "get_for_reply"])
def test_a_damaged_record_is_a_miss_and_never_returned(tmp_path: Path, at: int, restart: bool, read: str) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(key(0), data_of(0)) and tier.put(key(1), data_of(1))
    flip_byte(tier, key(0), at)
    if restart:
        tier = DiskTier(tmp_path, 10**6)
    assert getattr(tier, read)(key(0)) is None
    assert not tier.contains(key(0))
    # Live, the damage is found by the read; after a restart a damaged header is not even indexed.
    assert tier.stats.corrupt_blocks == (0 if restart and at != -1 else 1)
    assert tier.get(key(1)) == data_of(1)  # its neighbour is untouched
    assert tier.used_bytes() == block_file_size(key(1), 5000) and len(tier) == 1


def test_a_record_of_another_key_at_the_slot_is_refused(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(key(0, "e1"), data_of(0))
    path, offset, _size = block_location(tier, key(0, "e1"))
    other = encode_header(key(0, "e2"), data_of(0)) + data_of(0)  # same length: another ETag
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(other)
    assert tier.get(key(0, "e1")) is None and tier.stats.corrupt_blocks == 1


def test_a_record_torn_by_a_crash_is_not_served(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    for i in range(3):
        assert tier.put(key(i), data_of(i))
    path, offset, size = block_location(tier, key(2))
    os.truncate(path, offset + size - 100)  # the last record was cut short
    again = DiskTier(tmp_path, 10**6)
    assert again.get(key(2)) is None and not again.contains(key(2))
    assert [again.get(key(i)) for i in range(2)] == [data_of(0), data_of(1)]
    # A record torn inside (zeros where its data should be) passes the scan and fails its checksum.
    with open(path, "r+b") as f:
        f.seek(block_location(again, key(1))[1] + 200)
        f.write(bytes(1000))
    third = DiskTier(tmp_path, 10**6)
    assert third.get(key(1)) is None and third.stats.corrupt_blocks == 1


def test_a_record_evicted_while_it_is_read_is_a_plain_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(key(0), data_of(0))
    assert tier.put(key(1), data_of(1))  # keeps the pack alive: the record is punched, not the pack unlinked
    read = tier.places.read

    def evicted_first(*args, **kwargs):
        tier.discard(key(0))  # another thread's eviction between the lookup and the read
        return read(*args, **kwargs)

    monkeypatch.setattr(tier.places, "read", evicted_first)
    assert tier.get(key(0)) is None
    assert tier.stats.corrupt_blocks == 0 and tier.stats.misses == 1


def test_a_block_put_again_leaves_one_copy(tmp_path: Path) -> None:
    legacy = DiskTier(tmp_path, 10**6, pack_small=False)
    assert legacy.put(key(0), data_of(0)) and legacy.put(key(1), data_of(1))
    assert len(block_files(tmp_path)) == 2
    tier = DiskTier(tmp_path, 10**6)  # an upgrade: block files an earlier version wrote are still read
    assert tier.get(key(0)) == data_of(0)
    assert tier.put(key(0), data_of(10))  # written again: now a record, and its file is gone
    assert tier.put(key(2), data_of(2)) and tier.put(key(2), data_of(12))  # a record replaced by a record
    assert len(block_files(tmp_path)) == 1
    again = DiskTier(tmp_path, 10**6)
    assert [again.get(key(i)) for i in range(3)] == [data_of(10), data_of(1), data_of(12)]
    assert again.used_bytes() == 3 * block_file_size(key(0), 5000)


def test_a_failing_disk_leaves_nothing_indexed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(key(0), data_of(0))

    def broken(*args, **kwargs):
        raise OSError(5, "injected")

    monkeypatch.setattr(os, "pwritev", broken)
    assert not tier.put(key(1), data_of(1))
    monkeypatch.undo()
    assert not tier.contains(key(1)) and tier.stats.errors == 1
    assert tier.health.consecutive_failures == 1  # reported to the tier's health
    assert tier.used_bytes() == block_file_size(key(0), 5000)
    assert tier.packs is not None and sum(p.live for p in tier.packs._packs.values()) == align_up(  # noqa: SLF001
        block_file_size(key(0), 5000))


def test_a_symlink_among_the_packs_is_never_followed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(key(0), data_of(0))
    secret = tmp_path / "elsewhere"
    secret.write_bytes(encode_header(key(1), data_of(1)) + data_of(1))
    (tmp_path / "packs" / f"1{PACK_SUFFIX}").symlink_to(secret)
    again = DiskTier(tmp_path, 10**6)
    assert not again.contains(key(1)) and again.get(key(0)) == data_of(0)


def test_concurrent_appends_reads_and_evictions_keep_the_invariants(tmp_path: Path) -> None:
    foot = block_file_size(key(0), 3000)
    capacity = 12 * foot
    tier = DiskTier(tmp_path, capacity)
    assert tier.packs is not None
    tier.packs.pack_bytes = 6 * DIRECT_ALIGN  # rotate often: seal and unlink packs under load
    keys = [key(i, f"e{j}") for i in range(10) for j in range(3)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                k = rng.choice(keys)
                expected = data_of(hash(k) % 251, 3000)
                op = rng.random()
                if op < 0.45:
                    tier.put(k, expected)
                elif op < 0.95:
                    got = (tier.get if op < 0.7 else tier.get_for_reply)(k)
                    assert got is None or bytes(got) == expected
                else:
                    tier.discard(k)
                assert tier.used_bytes() <= capacity
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.stats.errors == 0 and tier.stats.corrupt_blocks == 0
    live = sum(p.live for p in tier.packs._packs.values())  # noqa: SLF001
    assert live == len(tier) * align_up(foot) and tier.used_bytes() == len(tier) * foot
    held = {k for k in keys if tier.contains(k)}
    again = DiskTier(tmp_path, capacity)
    assert {k for k in keys if again.contains(k)} == held
    assert all(again.get(k) == data_of(hash(k) % 251, 3000) for k in held)


def test_a_pack_whose_records_are_gone_is_unlinked_once_sealed(tmp_path: Path) -> None:
    files = PackFiles(tmp_path / "packs", "disk", pack_bytes=2 * DIRECT_ALIGN)
    header = encode_header(key(0), b"x" * 100)
    a = files.append(header, b"x" * 100)
    b = files.append(header, b"x" * 100)
    c = files.append(header, b"x" * 100)  # a third record: the first pack is full and sealed
    assert a.pack == b.pack != c.pack
    files.free(a, len(header) + 100)
    assert Path(files.path(a.pack)).exists()
    files.free(b, len(header) + 100)
    assert not Path(files.path(a.pack)).exists()
    files.free(c, len(header) + 100)
    assert Path(files.path(c.pack)).exists()  # the active pack stays for the next append
    files.close()


def open_packs(directory: Path) -> list[str]:
    """The pack files under ``directory`` this process holds open (deleted ones end in " (deleted)")."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and PACK_SUFFIX in target:
            targets.append(target)
    return targets


def test_no_descriptor_holds_a_removed_pack(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    assert tier.packs is not None
    tier.packs.pack_bytes = 2 * align_up(block_file_size(key(0), 5000))  # two records a pack
    for i in range(8):
        assert tier.put(key(i), data_of(i))
    assert [bytes(tier.get_for_reply(key(i)) or b"") for i in range(8)] == [data_of(i) for i in range(8)]
    assert len(open_packs(tmp_path)) == 1  # the pack taking appends; reads open and close theirs
    first = packs(tmp_path)[0]
    tier.discard(key(0))
    tier.discard(key(1))  # the pack is empty and sealed: unlinked
    assert not first.exists()
    assert [t for t in open_packs(tmp_path) if t.endswith("(deleted)")] == []
    tier.packs.close()
    assert open_packs(tmp_path) == []


def test_a_pack_that_cannot_be_created_is_a_failed_write_and_the_next_one_is_tried(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiering.tiers.packs as packs_module

    tier = DiskTier(tmp_path, 10**6)
    assert tier.packs is not None
    tier.packs.pack_bytes = 3 * DIRECT_ALIGN  # a record of 5,000 bytes and one of a page
    assert tier.put(key(0), data_of(0))
    real = packs_module.open_private

    def full(path, flags):  # noqa: ANN001 - the signature of open_private
        if flags & os.O_CREAT:
            raise OSError(28, "No space left on device")
        return real(path, flags)

    monkeypatch.setattr(packs_module, "open_private", full)
    assert not tier.put(key(1), data_of(1))  # does not fit the first pack: sealed, and the next cannot be made
    assert tier.stats.errors == 1 and not tier.contains(key(1))
    monkeypatch.undo()
    # A page-sized record would fit what is left of the sealed pack: it goes to a new one.
    assert tier.put(key(2), data_of(2, 100)) and tier.get(key(2)) == data_of(2, 100)
    assert block_location(tier, key(2))[0] != block_location(tier, key(0))[0]
    assert tier.get(key(0)) == data_of(0)


def test_without_hole_punching_an_evicted_record_is_not_found_again(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem (or libc) without fallocate(PUNCH_HOLE): the record's header page is zeroed, so a
    restart does not index it again; its space comes back with its pack."""
    import tiering.tiers.packs as packs_module

    monkeypatch.setattr(packs_module, "_FALLOCATE", None)
    tier = DiskTier(tmp_path, 10**6)
    assert tier.put(key(0), data_of(0)) and tier.put(key(1), data_of(1))
    path, offset, _size = block_location(tier, key(0))
    tier.discard(key(0))
    assert tier.packs is not None and tier.packs.punched == 0
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(DIRECT_ALIGN) == bytes(DIRECT_ALIGN)
    again = DiskTier(tmp_path, 10**6)
    assert not again.contains(key(0)) and again.get(key(1)) == data_of(1)
    assert again.used_bytes() == block_file_size(key(1), 5000)
