"""Evidence for issue 37, item 8: ``kept_newer: ['k4']`` where nobody else wrote is a real race, not timing.

``tests/fuse/test_durable_writeback.py::test_kill_9_while_writing_loses_nothing_acknowledged_once_recovered``
failed at load 13-36 with ``kept_newer: ['k4']``. The window, in ``tiering.writeback.durable``: when the
writer's own upload of an older version lands after a newer record was mirrored, ``uploaded()`` puts
that record again with the new ETag as its base. A daemon killed between the source's PUT landing
and that re-put (a cluster-store round trip, long on a loaded machine) leaves the newer record with
the old base; ``cachefs recover`` then takes the writer's own upload for someone else's newer
version, keeps it, and the acknowledged newer version is never applied: lost. Here the re-put fails
(the cluster store is unreachable for that moment) instead of being cut by SIGKILL: the same journal
state, deterministically. The fix belongs to the journal format (``tiering.writeback.durable``, being
changed by another branch): strict xfail, so that it fails loudly once the race is closed and this
marker must go.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.unit.test_durable_writeback import BreakableStore, GatedStore, Node, write
from tiering.writeback.recovery import recover_prefix


@pytest.mark.xfail(strict=True, reason="issue 37 item 8: a kill between an upload landing and the re-put of the "
                                       "newer record's base loses the acknowledged newer version (kept_newer)")
async def test_a_kill_between_an_upload_landing_and_the_base_update_loses_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source, cluster = GatedStore(), BreakableStore()
    node = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await node.wb.start()
    await write(node.wb, "f", b"v1")
    await asyncio.wait_for(source.started.wait(), 5)  # v1's upload is in flight
    await write(node.wb, "f", b"v2, acknowledged while v1 was uploading", may_exist=True)
    source.started.clear()
    cluster.down = True  # the re-put of v2's base does not happen (as when the daemon is killed there)
    source.gates[0].set()  # v1 lands in the source
    for _ in range(500):  # until the writer has seen v1 land and failed to update v2's base (bounded)
        if "could not update the base" in caplog.text:
            break
        await asyncio.sleep(0.01)
    assert "could not update the base" in caplog.text
    assert source._objects["f"].data == b"v1"
    prefix = node.durable.prefix
    node.lose()
    cluster.down = False
    report = await recover_prefix(source, cluster, prefix, owner="r", assume_dead=True)
    for gate in source.gates:
        gate.set()
    # What the durability promise says: v2 was acknowledged, nobody else wrote, so recovery applies it.
    assert report.kept_newer == [] and report.uploaded == ["f"], report
    assert source._objects["f"].data == b"v2, acknowledged while v1 was uploading"
