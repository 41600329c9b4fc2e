"""Staging space at the edges (issue 19): a hole is not staged data.

``truncate -s 11G`` on a 10 GiB disk cache waited ``--dirty-wait`` and failed with ENOSPC although
nothing was pending: the extension was charged as staged bytes. Space is charged for bytes written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_writeback import Rig, settle
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
