"""The write-back engine without a mount: staging, journal, replay after a crash, the uploader.

A "crash" is simulated by building a second ``WriteBack`` over the same staging directory without
stopping the first one (its uploader is cancelled without any of ``stop()``'s clean-up), which is
what the next mount after a kill -9 sees: the files on disk, nothing else.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import threading
from pathlib import Path

import pytest

from tiering.blocks import MIN_BLOCK_SIZE, ObjectRef
from tiering.clock import FakeClock
from tiering.engine.blockcache import BlockCache
from tiering.errors import AccessDeniedError, ObjectStoreUnavailableError
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.writeback import InMemoryBudget, UploadError, WriteBack, WriteBackSettings
from tiering.writeback.journal import DELETE, PUT, Record, StagingDir, decode_record, encode_record, record_name
from tiering.writeback.settings import STORE_PROBE_CAP_S
from tiering.writeback.staged import StagedFile

BS = MIN_BLOCK_SIZE
MiB = 1024 * 1024


class Rig:
    """One write-back engine over an in-memory store (wrapped to inject failures)."""

    def __init__(self, root: Path, *, store: InMemoryObjectStore | None = None, budget: int = 64 * MiB,
                 settings: WriteBackSettings | None = None, clock: FakeClock | None = None) -> None:
        self.root = root
        self.inner = store or InMemoryObjectStore()
        self.store = FailingObjectStore(self.inner)
        self.clock = clock or FakeClock()
        self.budget = InMemoryBudget(budget)
        self.settings = settings or WriteBackSettings(upload_delay_s=0, space_wait_s=0.2)
        cache_settings = CacheSettings(block_size=BS, ram_bytes=16 * BS)
        self.cache = BlockCache(cache_settings, self.store, RamTier(16 * BS))
        self.wb = self.new_engine()

    def new_engine(self) -> WriteBack:
        return WriteBack(self.settings, self.root / "staging", self.store, self.cache, self.budget,
                         clock=self.clock, rng=random.Random(1))

    async def crash_and_restart(self) -> WriteBack:
        """kill -9 and the next mount: the old engine's tasks die, a new one replays the disk."""
        old = self.wb
        for task in [old.uploader.task, *old.uploader.running, *old._background]:
            if task is not None:
                task.cancel()
        await asyncio.sleep(0)
        old.datafiles.close_all()
        self.budget = InMemoryBudget(self.budget.capacity_bytes)
        self.wb = self.new_engine()
        await self.wb.start()
        return self.wb

    def data(self, key: str) -> bytes:
        return self.inner._objects[key].data

    def keys(self) -> list[str]:
        return self.inner.keys()


@pytest.fixture
async def rig(tmp_path: Path):
    r = Rig(tmp_path)
    await r.wb.start()
    try:
        yield r
    finally:
        await r.wb.stop()


async def settle(wb: WriteBack, timeout: float = 5.0) -> None:
    report = await wb.flush(timeout)
    assert report.ok, report.pending


async def eventually(check, timeout: float = 2.0) -> None:
    """Staged data files are removed in the background once nothing holds them."""
    for _ in range(int(timeout / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    assert check()


async def write_file(wb: WriteBack, key: str, data: bytes, *, commit: bool = True):
    sf = await wb.create(key, may_exist=False)
    wb.hold(sf)
    await wb.write(sf, 0, data)
    if commit:
        await wb.commit(sf)
    return sf


# ------------------------------------------------------------------------------------------ format
def test_record_format_is_pinned() -> None:
    record = Record("ckpt/a.pt", PUT, 42, data="0123456789abcdef01234567.dat", size=1048576, crc32=305419896,
                    mtime=1700000000.5, since=1700000000.25, may_exist=False)
    raw = encode_record(record)
    assert raw == (
        b'd4253573 {"crc32":305419896,"data":"0123456789abcdef01234567.dat","format":1,"key":"ckpt/a.pt",'
        b'"may_exist":false,"mtime":1700000000.5,"op":"put","seq":42,"since":1700000000.25,"size":1048576}\n'
    )
    assert decode_record(raw) == record
    assert record_name("ckpt/a.pt") == "1566af81a9bbac0974b5b2b170fcb26e.rec"  # sha256(key)[:32]
    for bad in (raw[:-1], raw.replace(b"1048576", b"1048577"), b"00000000 {}\n", b""):
        with pytest.raises(ValueError):
            decode_record(bad)


def test_unknown_staging_format_is_refused(tmp_path: Path) -> None:
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / "FORMAT").write_text("cachefs-staging 99\n")
    from tiering.writeback.journal import StagingFormatError

    with pytest.raises(StagingFormatError):
        StagingDir(tmp_path / "staging")


# ------------------------------------------------------------------------------------------ basics
async def test_write_commit_upload_and_dispose(rig: Rig) -> None:
    data = os.urandom(3 * BS + 17)
    sf = await write_file(rig.wb, "a/b.bin", data)
    assert rig.wb.status("a/b.bin")["stage"] in ("dirty", "uploading")
    assert await rig.wb.read(sf, 0, len(data) + 10) == data
    await settle(rig.wb)
    assert rig.data("a/b.bin") == data
    assert rig.wb.status("a/b.bin") is None
    assert list((rig.root / "staging" / "records").iterdir()) == []
    rig.wb.unhold(sf)
    await eventually(lambda: sf.disposed and os.listdir(rig.root / "staging" / "data") == [], timeout=10)
    assert rig.wb.file("a/b.bin") is None
    assert rig.budget.reserved_space() == 0
    stats = rig.wb.stats_snapshot()
    assert stats["files_uploaded"] == 1 and stats["bytes_uploaded"] == len(data) and stats["dirty_files"] == 0


async def test_nothing_is_uploaded_before_acknowledgement(rig: Rig) -> None:
    sf = await write_file(rig.wb, "open.bin", b"x" * 1000, commit=False)
    assert rig.wb.status("open.bin")["stage"] == "writing"
    await asyncio.sleep(0.05)
    assert rig.keys() == []
    await rig.wb.commit(sf)
    await settle(rig.wb)
    assert rig.data("open.bin") == b"x" * 1000


async def test_flush_neither_uploads_nor_waits_for_unacknowledged_writes(rig: Rig) -> None:
    sf = await write_file(rig.wb, "half", b"first version")
    await settle(rig.wb)
    await rig.wb.truncate(sf, 0)
    await rig.wb.write(sf, 0, b"half-writ")  # an overwrite in progress: not closed, not fsync'd
    report = await rig.wb.flush(1)
    assert report.ok and report.unsynced == [{"key": "half", "size": 9}]
    assert rig.data("half") == b"first version"  # never a half-written object in the store
    await rig.wb.commit(sf)
    await settle(rig.wb)
    assert rig.data("half") == b"half-writ"


async def test_the_coalescing_delay(tmp_path: Path) -> None:
    clock = FakeClock()
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=30, space_wait_s=0.2), clock=clock)
    await r.wb.start()
    try:
        await write_file(r.wb, "later", b"1")
        await asyncio.sleep(0.05)
        assert r.keys() == []
        assert r.wb.status("later")["next_attempt_in_s"] == 30
        clock.advance(31)
        r.wb.poke()
        for _ in range(50):
            await asyncio.sleep(0.01)
            if r.keys():
                break
        assert r.data("later") == b"1"
    finally:
        await r.wb.stop()


async def test_a_file_that_keeps_changing_is_uploaded_within_the_max_delay(tmp_path: Path) -> None:
    """Every close restarts the coalescing delay (2 s here), but not past the max delay (5 s) after the
    oldest acknowledged version not yet in the store; after that upload, the next version counts anew."""
    clock = FakeClock()
    settings = WriteBackSettings(upload_delay_s=2, upload_max_delay_s=5, space_wait_s=0.2)
    r = Rig(tmp_path, settings=settings, clock=clock)
    await r.wb.start()

    async def uploaded(expected: bytes) -> bool:
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "log" in r.keys() and r.data("log") == expected:
                return True
        return False

    try:
        sf = await write_file(r.wb, "log", b"0")
        content = b"0"
        for second in range(1, 5):  # appended and closed every second: the delay alone never ends
            clock.advance(1)
            content += str(second).encode()
            await r.wb.write(sf, len(content) - 1, content[-1:])
            await r.wb.commit(sf)
            r.wb.poke()
            await asyncio.sleep(0.02)
            assert r.keys() == [], f"uploaded {second} s after the first close, before the max delay"
        assert r.wb.status("log")["next_attempt_in_s"] == 1  # 5 s after the first acknowledgement
        clock.advance(1)
        r.wb.poke()
        assert await uploaded(content), "not uploaded at the max delay"
        # The next version's wait counts from its own acknowledgement, not from the first one.
        clock.advance(1)
        await r.wb.write(sf, len(content), b"5")
        await r.wb.commit(sf)
        assert r.wb.status("log")["next_attempt_in_s"] == 2
    finally:
        await r.wb.stop()


async def test_a_file_saved_by_rename_every_second_is_uploaded_within_the_max_delay(tmp_path: Path) -> None:
    """Save-by-rename (write a temporary file, rename it over the target) every second: each rename is a
    new acknowledgement of the target, but its wait counts from the oldest one not yet uploaded."""
    clock = FakeClock()
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=2, upload_max_delay_s=5, space_wait_s=0.2),
            clock=clock)
    await r.wb.start()
    try:
        for second in range(5):
            sf = await write_file(r.wb, "ckpt.tmp", f"step {second}".encode())
            await r.wb.move("ckpt.tmp", "ckpt", dst_may_exist=second > 0)
            r.wb.unhold(sf)
            r.wb.poke()
            await asyncio.sleep(0.02)
            assert "ckpt" not in r.keys()
            clock.advance(1)
        r.wb.poke()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if "ckpt" in r.keys():
                break
        assert r.data("ckpt") == b"step 4", "the target of repeated renames was not uploaded at the max delay"
    finally:
        await r.wb.stop()


def test_max_delay_defaults_and_refusals() -> None:
    assert WriteBackSettings().max_delay_s == 30
    assert WriteBackSettings(upload_delay_s=600).max_delay_s == 600  # a longer coalescing delay is kept
    assert WriteBackSettings(upload_delay_s=1, upload_max_delay_s=3).max_delay_s == 3
    with pytest.raises(ValueError, match="must not be shorter than --upload-delay"):
        WriteBackSettings(upload_delay_s=10, upload_max_delay_s=3)
    with pytest.raises(ValueError, match="--stop-timeout"):
        WriteBackSettings(stop_timeout_s=-1)


async def test_append_after_commit_does_not_copy_but_a_rewrite_does(rig: Rig) -> None:
    wb = rig.wb
    rig.store.write_delay_s = 0.5  # keep the upload from finishing while we look
    sf = await write_file(wb, "log", b"a" * 5000)
    first = sf.acked
    await wb.write(sf, 5000, b"b" * 5000)  # an append: in place
    assert sf.current is first.data and wb.stats.copy_on_write_bytes == 0
    await wb.commit(sf)
    await wb.write(sf, 10, b"ZZ")  # inside the acknowledged prefix: copy-on-write
    assert sf.current is not sf.acked.data
    assert wb.stats.copy_on_write_bytes == 10_000
    assert await wb.read(sf, 0, 20) == b"a" * 10 + b"ZZ" + b"a" * 8
    rig.store.write_delay_s = 0
    await wb.commit(sf)
    await settle(wb)
    assert rig.data("log") == b"a" * 10 + b"ZZ" + b"a" * 4988 + b"b" * 5000


async def test_truncate_shrink_grow_and_inside_the_acknowledged_prefix(rig: Rig) -> None:
    wb = rig.wb
    sf = await write_file(wb, "t", b"0123456789")
    await wb.truncate(sf, 4)
    assert await wb.read(sf, 0, 100) == b"0123"
    await wb.truncate(sf, 8)
    assert await wb.read(sf, 0, 100) == b"0123\0\0\0\0"
    await wb.commit(sf)
    await settle(wb)
    assert rig.data("t") == b"0123\0\0\0\0"
    await wb.truncate(sf, 0)
    await wb.write(sf, 0, b"new")
    await wb.commit(sf)
    await settle(wb)
    assert rig.data("t") == b"new"


async def test_a_file_in_the_store_is_copied_in_on_first_change(rig: Rig) -> None:
    base = os.urandom(3 * BS + 100)
    info = rig.inner.put_object("big", base)
    sf = rig.wb.stage("big", ObjectRef("big", info.etag, info.size))
    rig.wb.hold(sf)
    assert rig.wb.status("big") is None  # staging alone changes nothing
    assert await rig.wb.read(sf, BS - 5, 10) == base[BS - 5:BS + 5]  # served from the block cache
    await rig.wb.write(sf, BS + 1, b"XYZ")
    expected = base[:BS + 1] + b"XYZ" + base[BS + 4:]
    assert await rig.wb.read(sf, 0, len(base)) == expected
    await rig.wb.commit(sf)
    await settle(rig.wb)
    assert rig.data("big") == expected
    assert rig.wb.stats.copy_on_write_bytes == len(base)


# ------------------------------------------------------------------------------------------ namespace
async def test_unlink_of_a_file_never_uploaded_sends_nothing(rig: Rig) -> None:
    rig.wb.settings = WriteBackSettings(upload_delay_s=60, space_wait_s=0.2)
    sf = await write_file(rig.wb, "tmp.part", b"data")
    await rig.wb.remove("tmp.part", may_exist=False)
    assert sf.detached
    await settle(rig.wb)
    assert rig.keys() == [] and rig.inner.stats.delete_requests == 0 and rig.inner.stats.put_requests == 0
    assert list((rig.root / "staging" / "records").iterdir()) == []


async def test_unlink_of_a_stored_object_deletes_it(rig: Rig) -> None:
    rig.inner.put_object("old", b"old")
    await rig.wb.remove("old", may_exist=True)
    assert rig.wb.status("old")["stage"] == "deleting"
    await settle(rig.wb)
    assert rig.keys() == []


async def test_unlink_during_an_upload_deletes_after_it(rig: Rig) -> None:
    rig.store.write_delay_s = 0.2
    await write_file(rig.wb, "racy", b"v1")
    for _ in range(100):
        await asyncio.sleep(0.01)
        if rig.wb.status("racy")["stage"] == "uploading":
            break
    await rig.wb.remove("racy", may_exist=False)  # the upload in flight makes it "may exist"
    rig.store.write_delay_s = 0
    await settle(rig.wb)
    assert rig.keys() == []
    assert rig.inner.stats.put_requests == 1 and rig.inner.stats.delete_requests == 1


async def test_rename_of_a_staged_file(rig: Rig) -> None:
    rig.wb.settings = WriteBackSettings(upload_delay_s=60, space_wait_s=0.2)
    await write_file(rig.wb, "ckpt.tmp", b"weights")
    await rig.wb.move("ckpt.tmp", "ckpt", dst_may_exist=False)
    assert rig.wb.file("ckpt").key == "ckpt" and rig.wb.file("ckpt.tmp") is None
    assert rig.wb.status("ckpt.tmp") is None  # never uploaded: nothing to delete
    await settle(rig.wb)
    assert rig.keys() == ["ckpt"] and rig.data("ckpt") == b"weights"
    assert rig.inner.stats.delete_requests == 0


async def test_directory_markers_and_rmdir_after_the_deletes_below(rig: Rig) -> None:
    wb = rig.wb
    await wb.mkdir("d")
    assert wb.created_dir("d")
    assert wb.merge("", {}) == {"d": None}
    await settle(wb)
    assert "d/" in rig.keys()
    rig.inner.put_object("d/f", b"f")
    order: list[str] = []
    rig.store.on_write = lambda op, key: order.append(f"{op} {key}")
    rig.store.write_delay_s = 0.1
    await wb.remove("d/f", may_exist=True)
    await wb.rmdir("d")  # must wait until the delete below it is done
    await settle(wb)
    assert order == ["delete d/f", "delete d/"]
    assert rig.keys() == []


async def test_merge_overlays_pending_operations(rig: Rig) -> None:
    wb = rig.wb
    wb.settings = WriteBackSettings(upload_delay_s=60, space_wait_s=0.2)
    stored = {"keep": rig.inner.put_object("d/keep", b"k"), "gone": rig.inner.put_object("d/gone", b"g"),
              "sub": None, "olddir": None}
    await write_file(wb, "d/new", b"12345")
    await wb.remove("d/gone", may_exist=True)
    await wb.mkdir("d/made")
    await wb.rmdir("d/olddir")
    await write_file(wb, "d/deep/er/file", b"x")
    view = wb.merge("d", stored)
    assert set(view) == {"keep", "sub", "new", "made", "deep"}
    assert view["new"].size == 5 and view["made"] is None and view["deep"] is None
    assert wb.merge("d/deep", {}) == {"er": None}
    assert wb.merge("elsewhere", stored) is stored  # nothing pending there: the same dict


# ------------------------------------------------------------------------------------------ crashes
async def test_crash_after_commit_replays_exactly_the_acknowledged_version(tmp_path: Path) -> None:
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2))
    await r.wb.start()
    v1 = os.urandom(200_000)
    sf = await write_file(r.wb, "ckpt", v1)
    await r.wb.write(sf, len(v1), b"unacknowledged tail")  # appended in place, never acknowledged
    await r.wb.write(sf, 100, b"rewritten")  # copy-on-write: the journal's file stays v1
    wb = await r.crash_and_restart()
    assert wb.status("ckpt")["stage"] in ("dirty", "uploading")
    await settle(wb)
    assert r.data("ckpt") == v1
    await eventually(lambda: os.listdir(r.root / "staging" / "data") == [])
    await wb.stop()


async def test_crash_before_any_acknowledgement_leaves_nothing(tmp_path: Path) -> None:
    r = Rig(tmp_path)
    await r.wb.start()
    await write_file(r.wb, "half", os.urandom(50_000), commit=False)
    wb = await r.crash_and_restart()
    await settle(wb)
    assert r.keys() == []
    await eventually(lambda: os.listdir(r.root / "staging" / "data") == [])
    await wb.stop()


async def test_crash_after_upload_before_record_removal_uploads_again(tmp_path: Path) -> None:
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2))
    await r.wb.start()
    await write_file(r.wb, "twice", b"same bytes")
    r.inner.put_object("twice", b"same bytes")  # the upload happened; the record is still there
    wb = await r.crash_and_restart()
    await settle(wb)
    assert r.data("twice") == b"same bytes"
    assert r.inner.stats.put_requests == 1
    await wb.stop()


async def test_corrupt_staged_data_is_quarantined_never_uploaded(tmp_path: Path) -> None:
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2))
    await r.wb.start()
    await write_file(r.wb, "bad", b"A" * 10_000)
    await write_file(r.wb, "good", b"B" * 10_000)
    data_dir = r.root / "staging" / "data"
    bad = r.wb.file("bad").acked.data.name
    with open(data_dir / bad, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff")
    wb = await r.crash_and_restart()
    await settle(wb)
    assert r.keys() == ["good"]
    assert wb.stats_snapshot()["quarantined"] == 1
    assert any(p.name.endswith(".rec") for p in (r.root / "staging" / "quarantine").iterdir())
    await wb.stop()


async def test_crash_in_the_middle_of_a_rename_keeps_both_names(tmp_path: Path) -> None:
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2))
    await r.wb.start()
    sf = await write_file(r.wb, "src", b"payload")
    # The first half of a rename: the destination's record names the same data file.
    r.wb.staging.write_record(Record("dst", PUT, 999, data=sf.acked.data.name, size=sf.acked.size,
                                     crc32=sf.acked.crc32, may_exist=False))
    wb = await r.crash_and_restart()
    await settle(wb)
    assert r.data("src") == b"payload" and r.data("dst") == b"payload"
    await wb.stop()


async def test_a_deleted_file_does_not_come_back_after_a_crash(tmp_path: Path) -> None:
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2))
    await r.wb.start()
    await write_file(r.wb, "new", b"1")
    await r.wb.remove("new", may_exist=False)
    r.inner.put_object("stored", b"2")
    await r.wb.remove("stored", may_exist=True)
    wb = await r.crash_and_restart()
    await settle(wb)
    assert r.keys() == []
    await wb.stop()


@pytest.mark.parametrize("seed", range(12))
async def test_random_operations_with_crashes_match_a_model(tmp_path: Path, seed: int) -> None:
    """Writes, truncates, commits, unlinks, renames and crashes at random, checked against a dict.

    The model holds, per key, the last acknowledged content (or None once unlinked); after the final
    flush the store must equal it exactly: every acknowledged byte, nothing else.
    """
    rng = random.Random(seed)
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=rng.choice([0, 0, 3600]), space_wait_s=0.2))
    await r.wb.start()
    keys = [f"k{i}" for i in range(4)]
    acked: dict[str, bytes | None] = {}  # what the store must hold in the end
    live: dict[str, bytearray] = {}  # what the open file holds now
    files: dict[str, object] = {}
    for step in range(120):
        op = rng.random()
        key = rng.choice(keys)
        wb = r.wb
        if op < 0.35:
            sf = files.get(key)
            if sf is None:
                sf = await wb.create(key, may_exist=acked.get(key) is not None)
                wb.hold(sf)
                files[key] = sf
                live[key] = bytearray()
            offset = rng.randrange(0, len(live[key]) + 3000)
            data = rng.randbytes(rng.randrange(1, 5000))
            await wb.write(sf, offset, data)
            buf = live[key]
            if offset > len(buf):
                buf.extend(b"\0" * (offset - len(buf)))
            buf[offset:offset + len(data)] = data
        elif op < 0.45 and key in files:
            size = rng.randrange(0, len(live[key]) + 2000)
            await wb.truncate(files[key], size)
            buf = live[key]
            del buf[size:]
            buf.extend(b"\0" * (size - len(buf)))
        elif op < 0.65 and key in files:
            await wb.commit(files[key])
            acked[key] = bytes(live[key])
        elif op < 0.72 and key in files:
            await wb.remove(key, may_exist=acked.get(key) is not None)
            acked[key] = None
            files.pop(key)
            live.pop(key)
        elif op < 0.78 and key in files:
            dst = rng.choice([k for k in keys if k != key])
            if dst in files:
                continue
            dst_may = acked.get(dst) is not None
            await wb.move(key, dst, dst_may_exist=dst_may)
            files[dst] = files.pop(key)
            live[dst] = live.pop(key)
            # A rename acknowledges the file's content, which moves; the source is deleted.
            acked[dst] = bytes(live[dst])
            acked[key] = None
        elif op < 0.85:
            await r.crash_and_restart()
            files.clear()
            live.clear()
        elif op < 0.9:
            await settle(r.wb)  # acknowledged changes only: open files' new bytes are not flushed
        await asyncio.sleep(0)
    for sf in files.values():
        await r.wb.commit(sf)
    for key in files:
        acked[key] = bytes(live[key])
    await settle(r.wb, 10)
    expected = {k: v for k, v in acked.items() if v is not None}
    assert {k: r.data(k) for k in r.keys()} == expected
    await r.wb.stop()


# ------------------------------------------------------------------------------------------ faults
async def test_an_unreachable_store_keeps_writes_staged_and_drains_when_back(rig: Rig) -> None:
    rig.store.fail_writes = True
    for i in range(5):
        await write_file(rig.wb, f"o/{i}", bytes([i]) * 1000)
    report = await rig.wb.flush(0.3)
    assert not report.ok and {p["key"] for p in report.pending} == {f"o/{i}" for i in range(5)}
    assert all("injected failure" in (p["last_error"] or "") for p in report.pending)
    stats = rig.wb.stats_snapshot()
    assert stats["store_state"] == "unreachable" and stats["failed_attempts"] >= 1 and stats["dirty_files"] == 5
    rig.store.fail_writes = False
    await settle(rig.wb)
    assert rig.keys() == [f"o/{i}" for i in range(5)]
    assert rig.wb.stats_snapshot()["store_state"] == "ok"


async def test_access_denied_surfaces_in_status_and_stats(rig: Rig) -> None:
    rig.store.fail_writes = True
    rig.store.write_error = AccessDeniedError("PUT s3://b/x: access denied: AccessDenied (HTTP 403)")
    await write_file(rig.wb, "x", b"1")
    report = await rig.wb.flush(0.3)
    assert not report.ok
    status = rig.wb.status("x")
    assert "AccessDenied" in status["last_error"] and status["attempts"] >= 1
    assert "AccessDenied" in rig.wb.stats_snapshot()["last_error"]


async def test_backoff_grows_and_is_capped(rig: Rig) -> None:
    delays = [rig.wb.uploader.backoff(n) for n in range(1, 12)]
    assert all(0.5 * min(60, 2 ** (n - 1)) <= d <= min(60, 2 ** (n - 1)) for n, d in zip(range(1, 12), delays))
    assert max(delays) <= 60
    # An unreachable store is probed more often: once it is back, the backlog drains within seconds.
    probes = [rig.wb.uploader.backoff(n, STORE_PROBE_CAP_S) for n in range(1, 12)]
    assert max(probes) <= STORE_PROBE_CAP_S < 60 and probes[-1] >= STORE_PROBE_CAP_S / 2


async def test_write_through_waits_for_the_upload_and_reports_failure(tmp_path: Path) -> None:
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2, write_through=True))
    await r.wb.start()
    try:
        await write_file(r.wb, "wt", b"through")
        assert r.data("wt") == b"through"  # commit returned only after the upload
        r.store.fail_writes = True
        with pytest.raises(UploadError) as info:
            await write_file(r.wb, "wt2", b"fails")
        assert info.value.errno == errno.EIO
        assert r.wb.status("wt2")["stage"] == "dirty"  # still staged, retried later
        r.store.fail_writes = False
        await settle(r.wb)
        assert r.data("wt2") == b"fails"
    finally:
        await r.wb.stop()


# ------------------------------------------------------------------------------------------ space
async def test_writers_wait_for_space_then_get_enospc(tmp_path: Path) -> None:
    r = Rig(tmp_path, budget=256 * 1024, settings=WriteBackSettings(upload_delay_s=0, space_wait_s=0.3))
    await r.wb.start()
    try:
        r.store.fail_writes = True
        await write_file(r.wb, "fill", b"x" * 200 * 1024)
        with pytest.raises(OSError) as info:
            await write_file(r.wb, "more", b"y" * 100 * 1024)
        assert info.value.errno == errno.ENOSPC
        assert r.budget.reserved_space() <= r.budget.capacity_bytes
        stats = r.wb.stats_snapshot()
        assert stats["enospc_errors"] == 1 and stats["space_waits"] >= 1
        # With the store back, a waiting writer gets its room as soon as uploads free it.
        r.store.fail_writes = False
        r.wb.uploader.kick()
        await write_file(r.wb, "after", b"z" * 100 * 1024)
        await settle(r.wb)
        assert r.data("fill") == b"x" * 200 * 1024 and r.data("after") == b"z" * 100 * 1024
    finally:
        await r.wb.stop()


async def test_staging_never_exceeds_the_budget_under_load(tmp_path: Path) -> None:
    r = Rig(tmp_path, budget=1 * MiB, settings=WriteBackSettings(upload_delay_s=0, space_wait_s=5))
    await r.wb.start()
    r.store.write_delay_s = 0.01
    peak = 0

    async def writer(i: int) -> None:
        nonlocal peak
        for j in range(6):
            sf = await r.wb.create(f"w{i}/{j}", may_exist=False)
            r.wb.hold(sf)
            for k in range(4):
                await r.wb.write(sf, k * 32 * 1024, bytes([j]) * 32 * 1024)
                peak = max(peak, r.budget.reserved_space())
            await r.wb.commit(sf)
            r.wb.unhold(sf)

    await asyncio.gather(*(writer(i) for i in range(6)))
    await settle(r.wb, 20)
    assert peak <= r.budget.capacity_bytes
    assert len(r.keys()) == 36 and all(r.data(k) == r.data(k)[:1] * 128 * 1024 for k in r.keys())
    await eventually(lambda: r.budget.reserved_space() == 0, timeout=10)
    await r.wb.stop()


async def test_a_full_budget_uploads_without_waiting_for_the_delay(tmp_path: Path) -> None:
    r = Rig(tmp_path, budget=1 * MiB, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=5))
    await r.wb.start()
    try:
        for i in range(12):  # 12 x 128 KiB > 1 MiB: only eager uploads make room
            await write_file(r.wb, f"e{i}", bytes([i]) * 128 * 1024)
            r.wb.unhold(r.wb.file(f"e{i}"))
        assert len(r.keys()) >= 4
    finally:
        await r.wb.stop()


async def test_unlink_of_an_open_file_keeps_its_data_for_the_handle(rig: Rig) -> None:
    sf = await write_file(rig.wb, "open", b"still readable")
    await rig.wb.remove("open", may_exist=False)
    assert await rig.wb.read(sf, 0, 100) == b"still readable"
    await rig.wb.write(sf, 0, b"STILL")
    assert await rig.wb.read(sf, 0, 5) == b"STILL"
    await rig.wb.commit(sf)  # a detached file acknowledges nothing
    await settle(rig.wb)
    assert rig.keys() == []
    rig.wb.unhold(sf)
    await eventually(lambda: sf.disposed and os.listdir(rig.root / "staging" / "data") == [], timeout=10)
    assert rig.budget.reserved_space() == 0


async def test_an_open_file_unlinked_before_its_first_change_keeps_the_stored_version(rig: Rig) -> None:
    """open(O_RDWR) of a stored file, unlink, then write and read through the handle (found by the
    write-back model test, eager uploads): the staged copy was only to be copied in on the first
    change, and with an upload delay of 0 the unlink's DELETE landed first, so the write's copy-in
    found no object (ENOENT through the mount). The unlink now copies it in before the delete."""
    base = os.urandom(2 * BS + 7)
    info = rig.inner.put_object("kept", base)
    sf = rig.wb.stage("kept", ObjectRef("kept", info.etag, info.size))
    rig.wb.hold(sf)  # the open handle
    await rig.wb.remove("kept", may_exist=True, base_etag=info.etag)
    await settle(rig.wb)
    assert rig.keys() == []  # the DELETE landed before any write
    await rig.wb.write(sf, 3, b"NEW")
    assert await rig.wb.read(sf, 0, len(base)) == base[:3] + b"NEW" + base[6:]
    await rig.wb.commit(sf)
    await settle(rig.wb)
    assert rig.keys() == []  # an unlinked file uploads nothing
    rig.wb.unhold(sf)
    await eventually(lambda: sf.disposed, timeout=10)


async def test_an_unlink_never_waits_for_staging_space_to_keep_an_open_file(tmp_path: Path) -> None:
    """Keeping the stored version for an open handle is best effort: with staging full (uploads
    failing), the unlink neither waits ``space_wait_s`` nor fails with ENOSPC (it used to do both)."""
    r = Rig(tmp_path, budget=1 * MiB, settings=WriteBackSettings(upload_delay_s=0, space_wait_s=5))
    await r.wb.start()
    try:
        info = r.inner.put_object("kept", os.urandom(4 * BS))
        r.store.fail_writes = True  # nothing staged can leave
        await write_file(r.wb, "filler", b"f" * (1 * MiB - 2 * BS))
        sf = r.wb.stage("kept", ObjectRef("kept", info.etag, info.size))
        r.wb.hold(sf)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(r.wb.remove("kept", may_exist=True, base_etag=info.etag), 2)
        assert asyncio.get_running_loop().time() - started < 1
        assert sf.detached and not sf.materialized  # not kept: its first write copies it in, as before
        r.wb.unhold(sf)
    finally:
        r.store.fail_writes = False
        await r.wb.stop()


async def test_an_unlink_racing_the_close_of_its_file_completes(rig: Rig, monkeypatch) -> None:
    """close() holds the file's lock while it syncs and then takes the key's; the unlink takes the
    key's lock first. Keeping the file for its handles used to wait for the file's lock under the
    key's: both waited for ever."""
    sf = await write_file(rig.wb, "racy", b"data", commit=False)  # held, not acknowledged
    syncing, go_on = threading.Event(), threading.Event()
    sync = rig.wb.datafiles.sync

    def slow_sync(*args):
        syncing.set()
        go_on.wait(5)
        return sync(*args)

    monkeypatch.setattr(rig.wb.datafiles, "sync", slow_sync)
    commit = asyncio.ensure_future(rig.wb.commit(sf))
    assert await asyncio.to_thread(syncing.wait, 5)  # the commit holds the file's lock
    remove = asyncio.ensure_future(rig.wb.remove("racy", may_exist=False))
    await asyncio.sleep(0.05)
    go_on.set()
    await asyncio.wait_for(asyncio.gather(commit, remove), 5)
    assert sf.detached
    await settle(rig.wb)
    assert rig.keys() == []
    rig.wb.unhold(sf)


async def test_a_failing_store_never_blocks_a_delete_behind_a_put(rig: Rig) -> None:
    rig.store.fail_writes = True
    await write_file(rig.wb, "p", b"1")
    await eventually(lambda: rig.wb.status("p")["attempts"] >= 1, timeout=10)
    rig.store.fail_writes = False
    await rig.wb.remove("p", may_exist=False)
    await settle(rig.wb)
    assert rig.keys() == []


async def test_replay_reserves_staged_bytes_even_past_the_capacity(tmp_path: Path) -> None:
    r = Rig(tmp_path, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2))
    await r.wb.start()
    await write_file(r.wb, "big", b"q" * 300 * 1024)
    r.budget = InMemoryBudget(64 * 1024)  # the capacity was lowered before the next mount

    old = r.wb
    for task in [old.uploader.task, *old.uploader.running, *old._background]:
        if task is not None:
            task.cancel()
    r.wb = r.new_engine()
    await r.wb.start()
    assert r.budget.reserved_space() > r.budget.capacity_bytes
    await settle(r.wb)
    assert r.data("big") == b"q" * 300 * 1024
    await r.wb.stop()


async def test_record_file_per_key(rig: Rig) -> None:
    rig.wb.settings = WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2)
    sf = await write_file(rig.wb, "one", b"1")
    await rig.wb.write(sf, 1, b"2")
    await rig.wb.commit(sf)
    records = list((rig.root / "staging" / "records").iterdir())
    assert [p.name for p in records] == [record_name("one")]
    record = decode_record(records[0].read_bytes())
    assert record.op == PUT and record.size == 2 and record.key == "one"
    await rig.wb.remove("one", may_exist=True)
    assert decode_record((rig.root / "staging" / "records" / record_name("one")).read_bytes()).op == DELETE


async def test_unavailable_store_backs_off_globally(rig: Rig) -> None:
    rig.store.fail_writes = True
    for i in range(3):
        await write_file(rig.wb, f"g{i}", b"x")
    await asyncio.sleep(0.2)
    attempts = rig.wb.stats_snapshot()["failed_attempts"]
    await asyncio.sleep(0.3)
    # Backing off: no storm of retries while the store is down.
    assert rig.wb.stats_snapshot()["failed_attempts"] - attempts <= 3
    assert isinstance(ObjectStoreUnavailableError("x"), Exception)


# ----------------------------------------------------------------------------------- write-behind
def test_write_behind_starts_write_out_every_so_many_bytes(tmp_path: Path, monkeypatch) -> None:
    from tiering.writeback import staged
    from tiering.writeback.settings import WRITE_BEHIND_BYTES

    calls: list[int] = []
    monkeypatch.setattr(staged, "start_write_out", lambda fd: calls.append(fd) or True)
    fd = os.open(tmp_path / "d.dat", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        df = staged.DataFile("d.dat", fd, 0)
        chunk = WRITE_BEHIND_BYTES // 4
        for _ in range(7):
            df.wrote(chunk)
        assert calls == [fd] and df.unflushed == 3 * chunk
        df.wrote(chunk)
        assert calls == [fd, fd] and df.unflushed == 0
    finally:
        os.close(fd)


def test_start_write_out_really_writes_dirty_pages_out(tmp_path: Path) -> None:
    from tiering.writeback.staged import start_write_out

    fd = os.open(tmp_path / "d.dat", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, b"x" * (1 << 20), 0)
        assert start_write_out(fd)  # glibc's sync_file_range on Linux
        assert not start_write_out(-1)  # EBADF: reported, never raised
    finally:
        os.close(fd)


# ------------------------------------------------------------------------ directory markers vs a tree
class DirectoryTreeStore(InMemoryObjectStore):
    """An in-memory store that behaves like a store keeping a real directory tree (SeaweedFS's filer):
    a write of a key creates its parent directories, and a directory marker put racing with that
    creation is lost (measured on SeaweedFS: about 1 in 60 concurrent pairs). A marker put waits on
    ``gate`` once it started (``marker_started`` is set), so a test can pause the uploader mid-marker."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.marker_started = asyncio.Event()
        self.in_flight: dict[str, bool] = {}  # marker key being put -> lost by a write below it
        self.overlaps: list[tuple[str, str]] = []  # (marker, key written below it meanwhile)

    def _below(self, key: str) -> None:
        for marker in self.in_flight:
            if key != marker and key.startswith(marker):
                self.in_flight[marker] = True
                self.overlaps.append((marker, key))

    async def put(self, key: str, size: int, read, **options):  # type: ignore[no-untyped-def]
        self._below(key)
        if not key.endswith("/"):
            return await super().put(key, size, read, **options)
        self.in_flight[key] = False
        self.marker_started.set()
        try:
            await asyncio.wait_for(self.gate.wait(), 5.0)
            info = await super().put(key, size, read, **options)
            if self.in_flight[key]:
                self.delete_object(key)  # the tree's implicit directory won: no marker object
            return info
        finally:
            del self.in_flight[key]

    async def copy(self, src: str, etag: str, dst: str, **options):  # type: ignore[no-untyped-def]
        self._below(dst)
        return await super().copy(src, etag, dst, **options)


async def test_a_marker_put_never_overlaps_a_write_below_it_so_a_renamed_tree_keeps_its_markers(
        tmp_path: Path) -> None:
    """Regression (tests/fuse/test_writeback_model.py, seed 2513373796): after a directory rename,
    the marker of a directory made through the mount was missing from the bucket. The marker puts of
    the destination tree and the uploads below them ran at once (flush starts everything due), and a
    store with a directory tree lost the marker to the implicit directory its child's put created."""
    store = DirectoryTreeStore()
    rig = Rig(tmp_path, store=store, settings=WriteBackSettings(upload_delay_s=60, space_wait_s=0.2))
    wb = rig.wb
    await wb.start()
    try:
        store.gate.set()
        await wb.mkdir("d1")
        await wb.mkdir("d1/sub")
        await write_file(wb, "d1/sub/f", b"data")
        await settle(wb)
        assert rig.keys() == ["d1/", "d1/sub/", "d1/sub/f"]
        store.gate.clear()
        store.marker_started.clear()
        # rename d1 -> d2, as the filesystem journals it: markers of the new tree, the files, then
        # the old tree's markers removed (deepest first).
        await wb.mkdir("d2")
        await wb.mkdir("d2/sub")
        await wb.move("d1/sub/f", "d2/sub/f", dst_may_exist=False)
        await wb.rmdir("d1/sub")
        await wb.rmdir("d1")
        flushing = asyncio.ensure_future(wb.flush(5.0))
        await asyncio.wait_for(store.marker_started.wait(), 5.0)  # the uploader is paused mid-marker
        for _ in range(20):
            await asyncio.sleep(0)  # whatever else the uploader would start now, it has started
        store.gate.set()
        report = await flushing
        assert report.ok, report.pending
        assert store.overlaps == []
        assert rig.keys() == ["d2/", "d2/sub/", "d2/sub/f"]
    finally:
        await wb.stop()


async def test_quiesce_waits_for_a_marker_put_above_the_key(tmp_path: Path) -> None:
    """A server-side copy into a directory (rename of a file only in the store) runs inside
    ``quiesce(dst)``: it must not overlap the directory's marker put either."""
    store = DirectoryTreeStore()
    rig = Rig(tmp_path, store=store)
    wb = rig.wb
    await wb.start()
    try:
        store.put_object("src", b"x")
        await wb.mkdir("d")
        await asyncio.wait_for(store.marker_started.wait(), 5.0)
        entered = asyncio.Event()

        async def copy_in() -> None:
            async with wb.quiesce("d/f"):
                entered.set()
                await store.copy("src", store._objects["src"].info.etag, "d/f")

        copying = asyncio.ensure_future(copy_in())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not entered.is_set()  # held off while the marker above is being put
        store.gate.set()
        await asyncio.wait_for(copying, 5.0)
        await settle(wb)
        assert store.overlaps == []
        assert rig.keys() == ["d/", "d/f", "src"]
    finally:
        await wb.stop()


async def test_a_full_staging_filesystem_is_logged_once_per_episode(rig: Rig, monkeypatch, caplog) -> None:
    """Another program filled the disk: every write gets ENOSPC, the log gets one line (issue 38,
    finding 5: the writer's ENOSPC was not logged at all), and another after a write has succeeded."""
    sf = await write_file(rig.wb, "a.bin", b"acknowledged", commit=True)
    full = [True]
    real = StagedFile.write_sync

    def write_sync(self, offset, data):  # type: ignore[no-untyped-def]
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, offset, data)

    monkeypatch.setattr(StagedFile, "write_sync", write_sync)
    caplog.set_level(logging.ERROR, logger="tiering.writeback")
    for _ in range(3):
        with pytest.raises(OSError) as raised:
            await rig.wb.write(sf, 0, b"more")
        assert raised.value.errno == errno.ENOSPC
    assert len([r for r in caplog.records if "staging filesystem is full" in r.getMessage()]) == 1
    full[0] = False
    await rig.wb.write(sf, 0, b"room again")
    full[0] = True
    with pytest.raises(OSError):
        await rig.wb.write(sf, 0, b"full again")
    assert len([r for r in caplog.records if "staging filesystem is full" in r.getMessage()]) == 2
    rig.wb.unhold(sf)
