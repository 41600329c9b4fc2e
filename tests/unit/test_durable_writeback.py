"""``--write-durability cluster`` without a mount: the mirror in the cluster store, leases, recovery.

Both stores are in memory (``InMemoryObjectStore``, whose ``put_if``/``delete_if`` refuse what S3
refuses: 412 for a failed condition, 404 for ``If-Match`` on an absent object). "The node is gone"
is the engine's tasks cancelled and its staging directory deleted: only the cluster store is left.
Uploads to the source are held off by a coalescing delay on a fake clock that never advances,
so every acknowledged change is still pending when the node goes.
"""

from __future__ import annotations

from dataclasses import asdict

import asyncio
import errno
import random
import shutil
from pathlib import Path

import pytest

from cachefs.cli.recover import EXIT_DAMAGE, EXIT_RETRY, exit_status
from tiering.engine.blockcache import BlockCache
from tiering.blocks import MIN_BLOCK_SIZE, ObjectRef
from tiering.clock import FakeClock
from tiering.errors import ObjectStoreUnavailableError
from tiering.objectstore.memory import InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.writeback import InMemoryBudget, WriteBack, WriteBackSettings
from tiering.writeback.durable import (
    ABSENT,
    DATA,
    JOURNAL,
    LEASE,
    RECOVERED,
    ClusterRecord,
    DurabilityError,
    DurableJournal,
    JournalKeys,
    read_lease,
)
from tiering.writeback.clusterjournal import TAG_WRITER
from tiering.writeback.recovery import RecoveryReport, list_writers, recover_prefix
from tests.support.clusterkeys import TEST_KEY

KEYS = JournalKeys.of(TEST_KEY)

BS = MIN_BLOCK_SIZE
MiB = 1024 * 1024
NEVER = 3600.0  # an upload delay the fake clock never reaches


class BreakableStore(InMemoryObjectStore):
    """The in-memory store, made unreachable on demand (every call fails as a dead endpoint does)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.refuse_data = False  # data pieces fail, journal objects land (a writer dying mid-fsync)

    def _gate(self) -> None:
        if self.down:
            raise ObjectStoreUnavailableError("cluster store unreachable (test)")

    async def put(self, key, size, read, **options):  # type: ignore[no-untyped-def]
        self._gate()
        if self.refuse_data and "/data/" in key:
            raise ObjectStoreUnavailableError("data piece lost (test)")
        return await super().put(key, size, read, **options)

    async def put_if(self, key, size, read, *, if_match=None, if_none_match=False, metadata=None):  # type: ignore[no-untyped-def]
        self._gate()
        return await super().put_if(key, size, read, if_match=if_match, if_none_match=if_none_match,
                                    metadata=metadata)

    async def delete(self, key):  # type: ignore[no-untyped-def]
        self._gate()
        return await super().delete(key)


class Node:
    """One writer: a write-back engine over ``root``, mirrored in ``cluster``."""

    def __init__(self, root: Path, source: InMemoryObjectStore, cluster: BreakableStore, *,
                 upload_delay_s: float = NEVER, name: str = "node-a", lease_ttl_s: float = 60.0) -> None:
        self.root, self.source, self.cluster = root, source, cluster
        self.clock = FakeClock()
        staging = root / "staging"
        staging.mkdir(parents=True, exist_ok=True)
        self.durable = DurableJournal(cluster, key=TEST_KEY, volume="vol1", node=name, source="s3://src", data_dir=staging / "data",
                                      staging_root=staging, lease_ttl_s=lease_ttl_s)
        cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=16 * BS), source, RamTier(16 * BS))
        self.wb = WriteBack(WriteBackSettings(upload_delay_s=upload_delay_s, space_wait_s=0.2), staging, source,
                            cache, InMemoryBudget(64 * MiB), clock=self.clock, rng=random.Random(1),
                            durable=self.durable)

    def lose(self) -> None:
        """The node is gone: tasks die, the cache directory with them."""
        for task in [self.wb.uploader.task, *self.wb.uploader.running, *self.wb._background,
                     self.durable._renewer, *self.durable._background]:
            if task is not None:
                task.cancel()
        self.wb.datafiles.close_all()
        shutil.rmtree(self.root)


async def write(wb: WriteBack, key: str, data: bytes, *, may_exist: bool = False) -> None:
    sf = await wb.create(key, may_exist=may_exist)
    wb.hold(sf)
    await wb.write(sf, 0, data)
    await wb.commit(sf)
    wb.unhold(sf)


def cluster_names(cluster: InMemoryObjectStore, prefix: str, sub: str) -> list[str]:
    return [k for k in cluster.keys() if k.startswith(prefix + sub)]


@pytest.fixture
def stores() -> tuple[InMemoryObjectStore, BreakableStore]:
    return InMemoryObjectStore(), BreakableStore()


async def test_close_returns_with_data_and_record_in_the_cluster_and_uploads_clean_them(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await node.wb.start()
    try:
        prefix = node.durable.prefix
        assert prefix.startswith("writeback/vol1/node-a/") and cluster.keys() == [prefix + LEASE]
        node.wb.uploader.task.cancel()  # hold uploads while looking at the cluster
        await asyncio.gather(node.wb.uploader.task, return_exceptions=True)
        await write(node.wb, "ckpt/a.pt", b"A" * 5000)
        [journal] = cluster_names(cluster, prefix, JOURNAL)
        record = ClusterRecord.decode(KEYS.records, journal, cluster._objects[journal].data)
        assert (record.key, record.size, record.base) == ("ckpt/a.pt", 5000, ABSENT)
        [(piece, length, _)] = record.segments
        assert length == 5000 and cluster._objects[prefix + piece].data == b"A" * 5000
        assert node.wb.status("ckpt/a.pt")["durable_in"] == "cluster"
        node.wb.uploader.start()
        assert (await node.wb.flush(5)).ok
        assert source._objects["ckpt/a.pt"].data == b"A" * 5000
        for _ in range(100):  # the data object goes in the background
            if cluster.keys() == [prefix + LEASE]:
                break
            await asyncio.sleep(0.01)
        assert cluster.keys() == [prefix + LEASE]
    finally:
        await node.wb.stop()
    assert cluster.keys() == []  # a clean stop with nothing pending removes the prefix


async def test_a_cluster_store_that_fails_fails_close_with_eio_and_nothing_is_acknowledged(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    try:
        cluster.down = True
        sf = await node.wb.create("lost.bin", may_exist=False)
        node.wb.hold(sf)
        await node.wb.write(sf, 0, b"never acknowledged")
        with pytest.raises(DurabilityError) as info:
            await node.wb.commit(sf)
        assert info.value.errno == errno.EIO
        assert list((tmp_path / "a" / "staging" / "records").iterdir()) == []  # no local fallback
        assert node.wb.status("lost.bin")["stage"] == "writing"
        cluster.down = False
        await node.wb.commit(sf)  # the store is back: the same file is acknowledged now
        assert node.wb.status("lost.bin")["durable_in"] == "cluster"
        node.wb.unhold(sf)
    finally:
        await node.wb.stop()


async def test_recovery_after_the_node_is_lost_applies_writes_renames_and_deletes_in_order(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    source.put_object("old.txt", b"old, to be deleted")
    source.put_object("shared.txt", b"version 0")
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "a.bin", b"first")
    await write(node.wb, "a.bin", b"second, last acknowledged")
    await write(node.wb, "ckpt.tmp", b"checkpoint bytes")
    await node.wb.move("ckpt.tmp", "ckpt.pt", dst_may_exist=False)
    await node.wb.remove("old.txt", may_exist=True, base_etag=source._objects["old.txt"].info.etag)
    sf = node.wb.stage("shared.txt", ObjectRef("shared.txt", source._objects["shared.txt"].info.etag, 9))
    node.wb.hold(sf)
    await node.wb.truncate(sf, 0)
    await node.wb.write(sf, 0, b"version 1 (ours)")
    await node.wb.commit(sf)
    await node.wb.mkdir("empty-dir")
    prefix = node.durable.prefix
    node.lose()
    source.put_object("shared.txt", b"version 2, written elsewhere meanwhile")
    assert source.keys() == ["old.txt", "shared.txt"]  # nothing reached the source before the loss

    assert await list_writers(cluster, "vol1") == [prefix]
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="recoverer:1", assume_dead=True)
    assert report.state == "recovered", report.detail
    assert source._objects["a.bin"].data == b"second, last acknowledged"
    assert source._objects["ckpt.pt"].data == b"checkpoint bytes"
    assert "ckpt.tmp" not in source.keys() and "old.txt" not in source.keys()
    assert source._objects["shared.txt"].data == b"version 2, written elsewhere meanwhile"
    assert report.kept_newer == ["shared.txt"]
    assert "empty-dir/" in source.keys()
    assert cluster.keys() == [prefix + LEASE]  # the tombstone only
    assert (await read_lease(cluster, prefix, KEYS.leases)).role == RECOVERED
    again = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="recoverer:2", assume_dead=True)
    assert again.state == "already"


async def test_recovery_uploads_carry_the_writers_mtime(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    """A recovered upload carries the mtime the file had when acknowledged (its last write, or what
    utimens set after close, which is journaled again), in rclone's ``mtime`` metadata."""
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "touched.bin", b"t")
    sf = node.wb.file("touched.bin")
    assert sf is not None
    await node.wb.set_mtime(sf, 1_500_000_000.25)  # rsync -t: utimes after close
    await write(node.wb, "written.bin", b"w")
    written = node.wb.file("written.bin")
    assert written is not None
    written_mtime = written.mtime
    prefix = node.durable.prefix
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert sorted(report.uploaded) == ["touched.bin", "written.bin"], report
    assert source._objects["touched.bin"].metadata["mtime"] == "1500000000.25"
    assert float(source._objects["written.bin"].metadata["mtime"]) == pytest.approx(written_mtime, abs=1e-6)


async def test_the_writers_own_upload_of_an_older_version_is_the_base_of_the_next(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await node.wb.start()
    await write(node.wb, "f", b"v1")
    assert (await node.wb.flush(5)).ok
    node.wb.uploader.task.cancel()  # v2 stays pending
    await write(node.wb, "f", b"v2", may_exist=True)
    prefix = node.durable.prefix
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.uploaded == ["f"] and source._objects["f"].data == b"v2", report


async def test_a_live_lease_is_not_taken_and_two_recoverers_never_share_a_prefix(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "x", b"x")
    prefix = node.durable.prefix
    held = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r0")
    assert held.state == "held" and "writer:node-a" in held.detail
    node.lose()
    first, second = await asyncio.gather(
        recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r1", assume_dead=True),
        recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r2", assume_dead=True))
    assert sorted([first.state, second.state]) in (["recovered", "taken"], ["already", "recovered"])
    assert source._objects["x"].data == b"x"
    assert source.stats.put_requests == 1  # uploaded once


async def test_a_writer_that_comes_back_to_a_prefix_taken_over_does_not_upload_it_again(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "y", b"acknowledged")
    prefix = node.durable.prefix
    for task in [node.wb.uploader.task, node.durable._renewer]:  # a partition: alive, cut off
        task.cancel()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.uploaded == ["y"]
    source.put_object("y", b"rewritten after the recovery")
    # The writer's next renewal finds the lease taken: it uploads nothing from then on.
    await node.durable._renew(node.durable._lease_etag)
    assert node.durable.taken_over
    with pytest.raises(Exception, match="taken over"):
        node.durable.check_may_upload()
    node.wb.datafiles.close_all()
    # Restarted on the same cache directory: the local journal is set aside, a new prefix begins.
    back = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await back.wb.start()
    try:
        assert back.durable.prefix != prefix
        assert (await back.wb.flush(2)).ok
        assert source._objects["y"].data == b"rewritten after the recovery"
        assert any(p.name.startswith("taken-over-") for p in (tmp_path / "a" / "staging").iterdir())
    finally:
        await back.wb.stop()


async def test_a_restart_on_the_same_cache_directory_continues_the_same_journal(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "z", b"z")
    prefix = node.durable.prefix
    await node.wb.stop()  # unmount --force: pending stays journaled, locally and in the cluster
    assert cluster_names(cluster, prefix, JOURNAL) and cluster_names(cluster, prefix, DATA)
    again = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await again.wb.start()
    try:
        assert again.durable.prefix == prefix
        assert (await again.wb.flush(5)).ok
        assert source._objects["z"].data == b"z"
    finally:
        await again.wb.stop()
    assert cluster.keys() == []


class GatedStore(InMemoryObjectStore):
    """A source whose puts wait for ``opened`` (one release per put): an upload held in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[asyncio.Event] = []
        self.started = asyncio.Event()

    async def put(self, key, size, read, **options):  # type: ignore[no-untyped-def]
        gate = asyncio.Event()
        self.gates.append(gate)
        self.started.set()
        await gate.wait()
        return await super().put(key, size, read, **options)

    async def put_if(self, key, size, read, **conditions):  # type: ignore[no-untyped-def]
        # The writer's tagged uploads (write durability cluster) come this way; the recoverer's
        # conditional puts (untagged: at most the file's mtime) pass.
        if TAG_WRITER not in (conditions.get("metadata") or {}):
            return await super().put_if(key, size, read, **conditions)
        gate = asyncio.Event()
        self.gates.append(gate)
        self.started.set()
        await gate.wait()
        return await super().put_if(key, size, read, **conditions)


async def test_an_upload_landing_after_a_newer_acknowledgement_becomes_that_records_base(tmp_path: Path) -> None:
    source, cluster = GatedStore(), BreakableStore()
    node = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await node.wb.start()
    await write(node.wb, "f", b"v1")
    await asyncio.wait_for(source.started.wait(), 5)  # v1's upload is in flight
    await write(node.wb, "f", b"v2, acknowledged while v1 was uploading", may_exist=True)
    source.started.clear()
    source.gates[0].set()  # v1 lands after v2 was acknowledged
    await asyncio.wait_for(source.started.wait(), 5)  # v2's upload starts, and never ends: the node goes
    assert source._objects["f"].data == b"v1"
    prefix = node.durable.prefix
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.uploaded == ["f"], report  # its base is v1's ETag: not taken for someone else's write
    source.gates[-1].set()
    assert source._objects["f"].data == b"v2, acknowledged while v1 was uploading"


async def test_a_clean_stop_removes_the_journal_and_the_next_mount_starts_a_new_one_quietly(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore], caplog: pytest.LogCaptureFixture) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await node.wb.start()
    await write(node.wb, "g", b"g")
    assert (await node.wb.flush(5)).ok
    first = node.durable.prefix
    await node.wb.stop()
    assert cluster.keys() == []
    again = Node(tmp_path / "a", source, cluster, upload_delay_s=0)
    await again.wb.start()
    try:
        assert again.durable.prefix != first and not again.durable.taken_over
        assert "set aside" not in caplog.text
        await write(again.wb, "h", b"h")
        assert (await again.wb.flush(5)).ok and source._objects["h"].data == b"h"
    finally:
        await again.wb.stop()


async def test_an_append_fsynced_again_sends_only_the_new_bytes_and_recovers_whole(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    sf = await node.wb.create("train.log", may_exist=False)
    node.wb.hold(sf)
    lines = [f"epoch {i}: loss {1 / (i + 1):.4f}\n".encode() * 50 for i in range(5)]
    for i, line in enumerate(lines):
        await node.wb.write(sf, sum(map(len, lines[:i])), line)
        await node.wb.commit(sf)  # fsync after every epoch
    prefix = node.durable.prefix
    assert node.durable.stats["data_bytes"] == sum(map(len, lines))  # each byte sent once
    for _ in range(100):  # superseded records go in the background; their pieces stay (shared)
        if len(cluster_names(cluster, prefix, JOURNAL)) == 1:
            break
        await asyncio.sleep(0.01)
    [journal] = cluster_names(cluster, prefix, JOURNAL)
    assert len(ClusterRecord.decode(KEYS.records, journal, cluster._objects[journal].data).segments) == 5
    assert len(cluster_names(cluster, prefix, DATA)) == 5
    # Overwriting the start of the file copies it (copy-on-write): the next record is sent whole.
    await node.wb.write(sf, 0, b"E")
    await node.wb.commit(sf)
    assert node.durable.stats["data_bytes"] == 2 * sum(map(len, lines))
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.uploaded == ["train.log"], report
    assert source._objects["train.log"].data == b"E" + b"".join(lines)[1:]
    assert cluster.keys() == [prefix + LEASE]


async def test_a_record_whose_data_never_landed_falls_back_to_the_acknowledged_one(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "ckpt", b"acknowledged version")
    cluster.refuse_data = True  # the journal object of the next version lands, its data does not
    with pytest.raises(DurabilityError):
        await write(node.wb, "ckpt", b"never acknowledged, longer version", may_exist=True)
    prefix = node.durable.prefix
    assert len(cluster_names(cluster, prefix, JOURNAL)) == 2
    node.lose()
    cluster.refuse_data = False
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.uploaded == ["ckpt"] and report.failed == [], report
    assert source._objects["ckpt"].data == b"acknowledged version"


async def test_a_first_version_that_was_never_acknowledged_is_a_note_not_damage(
        tmp_path: Path, stores: tuple[InMemoryObjectStore, BreakableStore]) -> None:
    """The node died during the close of a new file (its journal object landed, its data did not):
    nothing was acknowledged, so recovery reports a note, uploads nothing, and is not "failed"
    (issue 38, finding 3: a periodic recover exited 3 for this ordinary case)."""
    source, cluster = stores
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "done.txt", b"acknowledged")
    cluster.refuse_data = True
    with pytest.raises(DurabilityError):
        await write(node.wb, "big.ckpt", b"the close of this one never returned")
    prefix = node.durable.prefix
    node.lose()
    cluster.refuse_data = False
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.failed == [] and report.uploaded == ["done.txt"], report
    assert [note.split()[0] for note in report.never_acknowledged] == ["big.ckpt"]
    assert "big.ckpt" not in source._objects
    assert exit_status([asdict(report)], named=True) == 0


def test_recover_exit_statuses_tell_done_retry_later_and_damage_apart() -> None:
    def report(state: str = "recovered", failed: tuple[str, ...] = (), role: str = "") -> dict:
        return asdict(RecoveryReport("p/", state=state, failed=list(failed), holder_role=role))

    assert exit_status([], named=False) == 0
    assert exit_status([report(), report("already")], named=False) == 0
    # --expired: a live writer is not a lost node; a recoverer's live lease (one that died) is "later"
    assert exit_status([report("held", role="writer")], named=False) == 0
    assert exit_status([report("held", role="recovering")], named=False) == EXIT_RETRY
    assert exit_status([report("held", role="writer")], named=True) == EXIT_RETRY
    assert exit_status([report("taken")], named=False) == EXIT_RETRY
    assert exit_status([report("lost")], named=True) == EXIT_RETRY
    assert exit_status([report("taken"), report(failed=("k",))], named=False) == EXIT_DAMAGE
    assert len({0, EXIT_RETRY, EXIT_DAMAGE, 2}) == 4  # 2: bad arguments (the CLI's usage errors)


class HangingStore(BreakableStore):
    """A cluster store that stops answering on demand (SIGSTOP-like): calls wait, never return."""

    def __init__(self) -> None:
        super().__init__()
        self.hang = False
        self.hung_calls = 0

    async def put(self, key, size, read, **options):  # type: ignore[no-untyped-def]
        if self.hang:
            self.hung_calls += 1
            await asyncio.Event().wait()
        return await super().put(key, size, read, **options)


async def test_a_close_after_an_fsync_that_timed_out_fails_at_once_while_the_store_is_silent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsync() failed with EIO after the deadline on a frozen cluster store; the close() that follows,
    with nothing written since, fails at once instead of waiting a second deadline (issue 38, finding
    6: 15 s + 15 s). New bytes, or an answer from the store since, get a full attempt again."""
    import tiering.writeback.durable as durable_module

    monkeypatch.setattr(durable_module, "DURABLE_DEADLINE_FLOOR_S", 0.2)
    source, cluster = InMemoryObjectStore(), HangingStore()
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    sf = await node.wb.create("log.txt", may_exist=False)
    node.wb.hold(sf)
    await node.wb.write(sf, 0, b"first line\n")
    cluster.hang = True
    with pytest.raises(DurabilityError):
        await node.wb.commit(sf)  # fsync: waits the deadline, then EIO
    tried = cluster.hung_calls
    with pytest.raises(DurabilityError, match="failed again at once"):
        await node.wb.commit(sf)  # close: nothing new, the store silent: no second wait
    assert cluster.hung_calls == tried
    await node.wb.write(sf, 11, b"second line\n")
    with pytest.raises(DurabilityError) as again:
        await node.wb.commit(sf)  # new bytes: a full attempt of their own
    assert "at once" not in str(again.value) and cluster.hung_calls > tried
    cluster.hang = False
    await write(node.wb, "other.txt", b"the store answers again")  # a record taken: it answered
    await node.wb.commit(sf)  # so this one is tried, and succeeds
    node.wb.unhold(sf)
    node.lose()


class LandsButNeverAnswers(InMemoryObjectStore):
    """A source whose next put lands and then never answers: the node dies with the upload's answer
    (the new ETag) unseen."""

    def __init__(self) -> None:
        super().__init__()
        self.swallow = False
        self.landed = asyncio.Event()

    async def put_if(self, key, size, read, *, if_match=None, if_none_match=False, metadata=None):  # type: ignore[no-untyped-def]
        info = await super().put_if(key, size, read, if_match=if_match, if_none_match=if_none_match,
                                    metadata=metadata)
        if self.swallow:
            self.swallow = False
            self.landed.set()
            await asyncio.Event().wait()
        return info

    async def delete(self, key):  # type: ignore[no-untyped-def]
        await super().delete(key)
        if self.swallow:
            self.swallow = False
            self.landed.set()
            await asyncio.Event().wait()


async def _rewrite_whose_upload_lands_unanswered(
        tmp_path: Path, data: bytes) -> tuple[LandsButNeverAnswers, BreakableStore, Node, asyncio.Future[object]]:
    """``ckpt`` (E0 in the source) rewritten with ``data`` and acknowledged; its upload then lands in
    the source and never answers (the flush that sent it is returned, still waiting)."""
    source, cluster = LandsButNeverAnswers(), BreakableStore()
    e0 = source.put_object("ckpt", b"version 0, in the source").etag
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    sf = await node.wb.create("ckpt", may_exist=True, base_etag=e0)
    node.wb.hold(sf)
    await node.wb.write(sf, 0, data)
    await node.wb.commit(sf)
    node.wb.unhold(sf)
    source.swallow = True
    flushing = asyncio.ensure_future(node.wb.flush(30))
    await asyncio.wait_for(source.landed.wait(), 10)
    return source, cluster, node, flushing


@pytest.mark.parametrize("then", ["write", "delete"])
async def test_the_writers_own_upload_landing_as_the_node_dies_is_not_taken_for_a_newer_version(
        tmp_path: Path, then: str) -> None:
    """v1 of a file in the source (E0) is rewritten (record 1, base E0) and its upload lands, but the
    node dies before the answer: record 2 (v2, or a delete), acknowledged meanwhile, still says base
    E0. The recoverer finds the source at v1, tagged as this writer's older upload, and applies record
    2 (found as a 'kept_newer' loss of an acknowledged write in 2 of 20 kill trials)."""
    source, cluster, node, flushing = await _rewrite_whose_upload_lands_unanswered(tmp_path, b"version 1, ours")
    assert source._objects["ckpt"].data == b"version 1, ours"
    if then == "write":
        await write(node.wb, "ckpt", b"version 2, ours, acknowledged last", may_exist=True)
    else:
        await node.wb.remove("ckpt", may_exist=True)
    prefix = node.durable.prefix
    flushing.cancel()
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.kept_newer == [] and report.failed == [], report
    if then == "write":
        assert report.uploaded == ["ckpt"]
        assert source._objects["ckpt"].data == b"version 2, ours, acknowledged last"
    else:
        assert report.deleted == ["ckpt"] and "ckpt" not in source._objects


async def test_someone_elses_version_is_still_kept(tmp_path: Path) -> None:
    """The tag check only ever recognises this writer's own older upload: an untagged object written
    by someone else after the acknowledgement stays (the rule of never overwriting a newer version)."""
    source, cluster = InMemoryObjectStore(), BreakableStore()
    e0 = source.put_object("shared", b"version 0").etag
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    sf = await node.wb.create("shared", may_exist=True, base_etag=e0)
    node.wb.hold(sf)
    await node.wb.write(sf, 0, b"ours")
    await node.wb.commit(sf)
    node.wb.unhold(sf)
    prefix = node.durable.prefix
    node.lose()
    source.put_object("shared", b"theirs, written after", metadata={"cachefs-writer": prefix + "x", "cachefs-seq": "0"})
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.kept_newer == ["shared"] and source._objects["shared"].data == b"theirs, written after"


class LateDeleteStore(BreakableStore):
    """A cluster store that stops answering DELETEs (they time out) but runs them later, when
    ``run_late`` is called: a store frozen with SIGSTOP and resumed."""

    def __init__(self) -> None:
        super().__init__()
        self.stall_deletes = False
        self.late: list[str] = []

    async def delete(self, key):  # type: ignore[no-untyped-def]
        if self.stall_deletes:
            self.late.append(key)
            await asyncio.Event().wait()
        return await super().delete(key)

    def run_late(self) -> None:
        for key in self.late:
            self._objects.pop(key, None)
        self.late.clear()


async def test_an_unlink_that_failed_on_a_frozen_store_keeps_the_file_recoverable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rm failed with EIO (the DELETE of u1's record timed out), so u1 stays acknowledged; the store
    then resumed and ran that DELETE; the node is lost. u1 must still reach the source through
    recovery: the record was put again under a name the late DELETE cannot reach (issue 38, finding 2:
    '0 files uploaded', u1 lost)."""
    import tiering.writeback.durable as durable_module

    monkeypatch.setattr(durable_module, "DURABLE_DEADLINE_FLOOR_S", 0.2)
    source, cluster = InMemoryObjectStore(), LateDeleteStore()
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "u1", b"acknowledged, then an unlink that failed")
    await write(node.wb, "u2", b"another file")
    cluster.stall_deletes = True
    with pytest.raises(DurabilityError):
        await node.wb.remove("u1", may_exist=False)
    cluster.stall_deletes = False
    for _ in range(200):  # the re-mirror runs in the background, at once
        if node.durable.stats["resettled"]:
            break
        await asyncio.sleep(0.01)
    assert node.durable.stats["resettled"] == 1
    cluster.run_late()  # the store resumes and runs the DELETE it was sent
    prefix = node.durable.prefix
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.failed == [] and report.forged == [] and sorted(report.uploaded) == ["u1", "u2"], report
    assert source._objects["u1"].data == b"acknowledged, then an unlink that failed"
    assert [k for k in cluster.keys() if k.startswith(prefix) and "/journal/" in k] == []  # swept


async def test_the_writers_own_delete_landing_as_the_node_dies_does_not_hide_a_newer_write(tmp_path: Path) -> None:
    """unlink(ckpt) is uploaded (its DELETE lands, the answer never comes), then ckpt is written again
    and acknowledged (its record says base E0, racing with that delete); the node dies. A delete leaves
    no tag: the record's ``racing`` tells the recoverer that an absent object may be its own delete,
    and the new version is written (If-None-Match), not taken for someone else's deletion."""
    source, cluster = LandsButNeverAnswers(), BreakableStore()
    e0 = source.put_object("ckpt", b"version 0, in the source").etag
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await node.wb.remove("ckpt", may_exist=True, base_etag=e0)
    source.swallow = True
    flushing = asyncio.ensure_future(node.wb.flush(30))
    await asyncio.wait_for(source.landed.wait(), 10)
    assert "ckpt" not in source._objects
    await write(node.wb, "ckpt", b"saved again, acknowledged", may_exist=True)
    prefix = node.durable.prefix
    flushing.cancel()
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.kept_newer == [] and report.uploaded == ["ckpt"], report
    assert source._objects["ckpt"].data == b"saved again, acknowledged"


async def test_the_records_own_upload_landing_as_the_node_dies_counts_as_uploaded(tmp_path: Path) -> None:
    """The upload of the latest record lands and the node dies before its answer (so before the record
    is removed): the recoverer finds the source holding exactly that upload (its tag names this record)
    and reports it uploaded, not 'left the newer version' (seen in 1 of 60 kill trials)."""
    source, cluster, node, flushing = await _rewrite_whose_upload_lands_unanswered(
        tmp_path, b"version 1, ours, the last")
    prefix = node.durable.prefix
    flushing.cancel()
    node.lose()
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.kept_newer == [] and report.uploaded == ["ckpt"], report
    assert source._objects["ckpt"].data == b"version 1, ours, the last"
