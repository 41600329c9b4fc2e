"""Staging space at the edges (issue 19): a hole is not staged data.

``truncate -s 11G`` on a 10 GiB disk cache waited ``--dirty-wait`` and failed with ENOSPC although
nothing was pending: the extension was charged as staged bytes. Space is charged for bytes written."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.unit.test_writeback import Rig, eventually, settle
from tiering.blocks import ObjectRef
from tiering.writeback import WriteBackSettings

KiB = 1024
BUDGET = 256 * KiB
SPARSE = 40 * BUDGET  # far larger than the whole budget


@pytest.fixture
async def rig(tmp_path: Path):
    r = Rig(tmp_path, budget=BUDGET, settings=WriteBackSettings(upload_delay_s=3600, space_wait_s=0.2))
    await r.wb.start()
    try:
        yield r
    finally:
        await r.wb.stop()


async def test_a_sparse_extension_reserves_nothing(rig: Rig) -> None:
    wb = rig.wb
    sf = await wb.create("sparse", may_exist=False)
    wb.hold(sf)
    await wb.write(sf, 0, b"head")
    before = rig.budget.reserved_space()
    await wb.truncate(sf, SPARSE)  # no wait, no ENOSPC
    assert rig.budget.reserved_space() == before
    assert await wb.read(sf, SPARSE // 2, 8) == bytes(8)
    await wb.write(sf, SPARSE, b"tail")  # at the end: charged the block it touches, not the hole
    await wb.commit(sf)
    assert rig.budget.reserved_space() <= BUDGET // 4
    assert wb.stats_snapshot()["enospc_errors"] == 0
    wb.settings = WriteBackSettings(upload_delay_s=0, space_wait_s=0.2)
    await settle(wb)
    data = rig.data("sparse")
    assert len(data) == SPARSE + 4 and data[:4] == b"head" and data[-4:] == b"tail"
    assert data[4:SPARSE] == bytes(SPARSE - 4)
    wb.unhold(sf)


async def test_writes_inside_a_hole_are_charged_the_blocks_they_touch(rig: Rig) -> None:
    wb = rig.wb
    sf = await wb.create("holes", may_exist=False)
    wb.hold(sf)
    await wb.truncate(sf, SPARSE)
    base = rig.budget.reserved_space()
    for i in range(8):
        await wb.write(sf, i * SPARSE // 8 + 100, b"x" * 10)  # one 4 KiB block each
    await wb.commit(sf)
    assert rig.budget.reserved_space() - base <= 8 * 4 * KiB + 4 * KiB
    wb.unhold(sf)


async def test_replay_charges_a_sparse_file_its_allocated_blocks(rig: Rig) -> None:
    wb = rig.wb
    sf = await wb.create("sparse", may_exist=False)
    wb.hold(sf)
    await wb.truncate(sf, SPARSE)
    await wb.write(sf, SPARSE, b"tail")
    await wb.commit(sf)
    wb = await rig.crash_and_restart()
    assert rig.budget.reserved_space() <= BUDGET // 4  # not its length: that is 40 times the budget
    wb.settings = WriteBackSettings(upload_delay_s=0, space_wait_s=0.2)
    await settle(wb)
    assert rig.data("sparse")[-4:] == b"tail"


# ------------------------------------------------------------------------------ a failed writer
async def fill_until_enospc(wb, sf, piece: int = 4 * KiB) -> int:
    """Write ``piece`` bytes at a time until the budget refuses one; the bytes written."""
    offset = 0
    while True:
        try:
            await wb.write(sf, offset, b"w" * piece)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            return offset
        offset += piece
        assert offset <= 2 * BUDGET, "the budget never filled"


async def failed_writer(rig: Rig, key: str, *, acked: bytes = b"") -> None:
    """A writer fills the budget (the store is down: no upload frees space), its close fails with
    ENOSPC, and it exits."""
    wb = rig.wb
    sf = await wb.create(key, may_exist=False)
    wb.hold(sf)
    if acked:
        await wb.write(sf, 0, acked)
        await wb.commit(sf)
    await fill_until_enospc(wb, sf)
    write_record = wb.records.write
    if acked:
        # Its record exists (its space too): make the acknowledgement fail another way, as a full
        # or failing staging disk would.
        async def failing(record):
            raise OSError(errno.ENOSPC, "injected: no space for the journal record")

        wb.records.write = failing
    try:
        with pytest.raises(OSError) as info:
            await wb.commit(sf)  # close(): not even the journal record fits
    finally:
        wb.records.write = write_record
    assert info.value.errno == errno.ENOSPC
    wb.unhold(sf)  # the writer has exited


@pytest.mark.parametrize("acked", [b"", b"acknowledged before"])
async def test_a_writer_whose_close_failed_does_not_wedge_the_cache(rig: Rig, acked: bytes) -> None:
    rig.store.fail_writes = True
    await failed_writer(rig, "wedge", acked=acked)
    # Its space comes back: another writer gets room without any upload.
    await eventually(lambda: rig.budget.reserved_space() <= BUDGET // 2)
    sf = await rig.wb.create("next", may_exist=False)
    rig.wb.hold(sf)
    await rig.wb.write(sf, 0, b"n" * (BUDGET // 4))
    await rig.wb.commit(sf)
    rig.wb.unhold(sf)
    # It is shown truthfully: not open, not unsynced; reverted to its last acknowledged state.
    report = await rig.wb.flush(0)
    assert report.unsynced == []
    status = rig.wb.status("wedge")
    assert status is not None and status["size"] == len(acked) and not status["unsynced"]
    assert rig.wb.stats_snapshot()["reverted_files"] == 1
    rig.store.fail_writes = False
    await settle(rig.wb)
    assert rig.data("wedge") == acked and rig.data("next") == b"n" * (BUDGET // 4)


async def test_a_store_file_whose_change_failed_reverts_to_the_store_version(rig: Rig) -> None:
    rig.inner.put_object("stored", b"original")
    rig.store.fail_writes = True
    wb = rig.wb
    info = await rig.store.head("stored")
    sf = wb.stage("stored", ObjectRef("stored", info.etag, info.size))
    wb.hold(sf)
    await fill_until_enospc(wb, sf)
    with pytest.raises(OSError):
        await wb.commit(sf)
    wb.unhold(sf)
    await eventually(lambda: wb.file("stored") is None and rig.budget.reserved_space() == 0)
    assert wb.status("stored") is None
    assert rig.data("stored") == b"original"
