"""Whole files on the disk tier (tiering.tiers.wholefile): the plain copy the kernel reads through passthrough.

Assembled only from blocks that pass their checks, counted in the tier's bytes, evicted like blocks,
and never trusted across a restart.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

from tiering.blocks import BlockKey, ObjectRef
from tiering.tiers.disk import DiskTier
from tiering.tiers.wholefile import WHOLE_DIRNAME
from tests.support.diskblocks import block_location, flip_byte

BLOCK = 4096


def stored(tier: DiskTier, ref: ObjectRef, data: bytes, skip: tuple[int, ...] = ()) -> None:
    for index, start in enumerate(range(0, len(data), BLOCK)):
        if index not in skip:
            assert tier.put(BlockKey(ref.key, ref.etag, index), data[start:start + BLOCK])


def whole_files(directory: Path) -> list[Path]:
    return sorted(p for p in (directory / WHOLE_DIRNAME).rglob("*") if p.is_file())


def test_a_whole_file_holds_the_objects_bytes_at_their_offsets(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(3 * BLOCK + 123)
    ref = ObjectRef("d/a.bin", '"e1"', len(data))
    tier = DiskTier(tmp_path, 10**6)
    stored(tier, ref, data)
    used = tier.used_bytes()
    path = tier.assemble_whole(ref, BLOCK)
    assert path is not None and path.read_bytes() == data
    assert tier.whole_file(ref) == str(path) and tier.whole_name(ref) == path
    assert os.stat(path).st_mode & 0o777 == 0o600
    # Counted like a block: the capacity covers the copy too.
    assert tier.used_bytes() == used + len(data)
    assert tier.whole_snapshot()["files"] == 1 and tier.whole_snapshot()["bytes"] == len(data)
    # Another version (ETag) or another size has another name: never taken for this one.
    assert tier.whole_file(ObjectRef("d/a.bin", '"e2"', len(data))) is None
    assert tier.whole_name(ObjectRef("d/a.bin", '"e1"', len(data) - 1)) != path


def test_an_empty_object_has_an_empty_whole_file(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    path = tier.assemble_whole(ObjectRef("empty", '"e"', 0), BLOCK)
    assert path is not None and path.read_bytes() == b""


def test_no_whole_file_of_a_partial_object(tmp_path: Path) -> None:
    data = random.Random(2).randbytes(3 * BLOCK)
    ref = ObjectRef("d/p.bin", '"e1"', len(data))
    tier = DiskTier(tmp_path, 10**6)
    stored(tier, ref, data, skip=(1,))
    used = tier.used_bytes()
    assert tier.assemble_whole(ref, BLOCK) is None
    assert whole_files(tmp_path) == [] and tier.used_bytes() == used


def test_a_corrupt_block_stops_the_assembly_and_is_dropped(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(2 * BLOCK)
    ref = ObjectRef("d/c.bin", '"e1"', len(data))
    tier = DiskTier(tmp_path, 10**6)
    stored(tier, ref, data)
    _path, _offset, size = block_location(tier, BlockKey(ref.key, ref.etag, 1))
    flip_byte(tier, BlockKey(ref.key, ref.etag, 1), -1)  # one flipped byte of data: the checksum fails
    used = tier.used_bytes()
    assert tier.assemble_whole(ref, BLOCK) is None
    assert whole_files(tmp_path) == []
    assert tier.stats.corrupt_blocks == 1 and tier.whole_stats.failed == 1
    assert not tier.contains(BlockKey(ref.key, ref.etag, 1))
    assert tier.used_bytes() == used - size


def test_whole_files_are_evicted_like_blocks_and_their_files_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 40 * BLOCK, high_watermark=0.9, low_watermark=0.5)
    first = random.Random(4).randbytes(4 * BLOCK)
    ref = ObjectRef("d/first", '"e"', len(first))
    stored(tier, ref, first)
    path = tier.assemble_whole(ref, BLOCK)
    assert path is not None and path.exists()
    # Newer blocks push the least recently used entries out, the whole file among them.
    for i in range(40):
        tier.put(BlockKey("d/other", '"e"', i), bytes(BLOCK))
        assert tier.used_bytes() <= tier.capacity_bytes
    assert tier.whole_file(ref) is None and not path.exists()
    assert tier.whole_snapshot()["files"] == 0


def test_evicting_every_unpinned_entry_and_discarding_one_version_remove_whole_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    data = random.Random(5).randbytes(BLOCK)
    refs = [ObjectRef(f"d/{n}", '"e"', len(data)) for n in "ab"]
    for ref in refs:
        stored(tier, ref, data)
        assert tier.assemble_whole(ref, BLOCK) is not None
    tier.discard_whole(refs[0])
    assert tier.whole_file(refs[0]) is None and tier.whole_file(refs[1]) is not None
    used = tier.used_bytes()
    assert tier.evict_unpinned() == (2, used)  # two blocks; the bytes of both the blocks and the whole file
    assert whole_files(tmp_path) == [] and tier.used_bytes() == 0


def test_whoever_keeps_a_whole_file_open_is_told_of_each_one_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 40 * BLOCK, high_watermark=0.9, low_watermark=0.5)
    told: list[tuple[Path, bool]] = []
    tier.on_whole_dropped(lambda path: told.append((path, path.exists())))
    data = random.Random(7).randbytes(2 * BLOCK)
    refs = [ObjectRef(f"d/{n}", '"e"', len(data)) for n in "abc"]
    paths = []
    for ref in refs:
        stored(tier, ref, data)
        paths.append(tier.assemble_whole(ref, BLOCK))
    tier.discard_whole(refs[0])  # discarded (cachefs evict of one file)
    assert told == [(paths[0], False)]  # after the unlink: the space is free once the holder lets go
    for i in range(40):  # evicted to make room
        tier.put(BlockKey("d/other", '"e"', i), bytes(BLOCK))
    assert (paths[1], False) in told and tier.whole_file(refs[1]) is None
    stored(tier, refs[2], data)
    tier.evict_unpinned()  # every unpinned entry
    assert sorted(p for p, _ in told) == sorted(paths) and not any(exists for _, exists in told)
    # A failing listener is logged; the eviction goes on.
    tier.on_whole_dropped(lambda path: 1 / 0)
    stored(tier, refs[0], data)
    assert tier.assemble_whole(refs[0], BLOCK) is not None
    tier.discard_whole(refs[0])
    assert told[-1] == (paths[0], False) and whole_files(tmp_path) == []
    assert tier.whole_snapshot()["files"] == 0


def test_whole_files_are_removed_at_start_up(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**6)
    data = random.Random(6).randbytes(2 * BLOCK)
    ref = ObjectRef("d/r", '"e"', len(data))
    stored(tier, ref, data)
    assert tier.assemble_whole(ref, BLOCK) is not None
    used_by_blocks = tier.used_bytes() - len(data)
    again = DiskTier(tmp_path, 10**6)
    # Only what this process checked is handed to the kernel: the copy goes, the blocks stay.
    assert whole_files(tmp_path) == [] and again.whole_file(ref) is None
    assert again.whole_stats.removed_at_start == 1 and again.used_bytes() == used_by_blocks
    assert again.assemble_whole(ref, BLOCK) is not None


def test_no_whole_file_where_it_does_not_fit(tmp_path: Path) -> None:
    data = random.Random(7).randbytes(4 * BLOCK)
    ref = ObjectRef("d/big", '"e"', len(data))
    tier = DiskTier(tmp_path, 6 * BLOCK, high_watermark=1.0, low_watermark=0.9)
    stored(tier, ref, data)
    # The blocks it would be copied from are not the room made for the copy.
    assert tier.assemble_whole(ref, BLOCK) is None
    assert all(tier.contains(BlockKey(ref.key, ref.etag, i)) for i in range(4))
    assert tier.used_bytes() <= tier.capacity_bytes and whole_files(tmp_path) == []
