"""The store-health circuit (tiering.storehealth) and what reads, listings and write-back do with it.

The circuit's cool-down runs on a FakeClock; a frozen store is a ``FailingObjectStore`` whose every
call sleeps an hour (``delay_s``), so only the deadlines under test decide when a call ends. No test
asserts a duration: each asserts the outcome (data, stale data, EIO) and how many store calls ran.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import time
from pathlib import Path

import pytest

from cachefs.daemon import metrics
from cachefs.daemon.stats import stats_document
from cachefs.fs.errors import FsError
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE, ObjectRef
from tiering.clock import FakeClock
from tiering.engine.blockcache import BlockCache
from tiering.errors import ObjectNotFoundError, ObjectStoreUnavailableError
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.storehealth import StoreHealth, StoreState, bounded
from tiering.writeback import InMemoryBudget, WriteBack, WriteBackSettings
from tiering.writeback import settings as wb_settings

BS = MIN_BLOCK_SIZE
FROZEN_S = 3600.0  # a "frozen" call: far longer than any deadline below
DEADLINE_S = 0.05


class Probe:
    def __init__(self) -> None:
        self.calls = 0
        self.fail = True

    async def __call__(self) -> None:
        self.calls += 1
        if self.fail:
            raise ObjectStoreUnavailableError("probe: still down")


async def settle_probe(health: StoreHealth) -> None:
    task = health._probe_task
    if task is not None:
        await asyncio.wait_for(task, 5)


# ------------------------------------------------------------------------------------------ the circuit
async def test_a_failure_opens_the_circuit_and_calls_fail_at_once() -> None:
    clock = FakeClock()
    health = StoreHealth(clock, probe=Probe(), probe_interval_s=5)
    assert health.state is StoreState.REACHABLE and health.unreachable_for() == 0
    health.record_failure(ObjectStoreUnavailableError("refused"))
    assert health.state is StoreState.UNREACHABLE and health.outages == 1
    clock.advance(7)
    assert health.unreachable_for() == 7
    called = []

    async def never() -> None:
        called.append(1)

    with pytest.raises(ObjectStoreUnavailableError) as info:
        await health.call(never, 1.0, "LIST /x")
    assert info.value.errno == errno.EIO and "unreachable" in str(info.value)
    assert called == [] and health.short_circuited == 1
    await health.close()


async def test_one_probe_per_interval_and_its_success_closes_the_circuit() -> None:
    clock = FakeClock()
    probe = Probe()
    health = StoreHealth(clock, probe=probe, probe_interval_s=5)
    woken = []
    health.on_reachable(lambda: woken.append(1))
    health.record_failure(TimeoutError())
    health.maybe_probe()
    health.maybe_probe()
    await settle_probe(health)
    assert probe.calls == 0, "the first probe waits one interval after the failure"
    clock.advance(5)
    for _ in range(3):
        health.maybe_probe()
    await settle_probe(health)
    assert probe.calls == 1 and not health.reachable  # a failed probe restarts the interval
    clock.advance(4)
    health.maybe_probe()
    await settle_probe(health)
    assert probe.calls == 1
    clock.advance(1)
    probe.fail = False
    health.maybe_probe()
    await settle_probe(health)
    assert probe.calls == 2 and health.reachable and health.unreachable_for() == 0 and woken == [1]
    assert health.outages == 1
    await health.close()


async def test_a_probe_that_hangs_is_cut_by_its_deadline() -> None:
    clock = FakeClock()

    async def frozen() -> None:
        await asyncio.sleep(FROZEN_S)

    health = StoreHealth(clock, probe=frozen, probe_interval_s=5, probe_timeout_s=DEADLINE_S)
    health.record_failure(TimeoutError())
    clock.advance(5)
    health.maybe_probe()
    await settle_probe(health)
    assert not health.reachable and health.probes == 1
    await health.close()


async def test_a_deadline_that_passes_opens_the_circuit_and_an_error_answer_does_not() -> None:
    health = StoreHealth(FakeClock())

    async def frozen() -> None:
        await asyncio.sleep(FROZEN_S)

    async def not_found() -> None:
        raise ObjectNotFoundError("HEAD s3://b/k: not found")

    with pytest.raises(ObjectNotFoundError):
        await health.call(not_found, 1.0, "HEAD k")
    assert health.reachable, "a store that answers with an error is reachable"
    with pytest.raises(ObjectStoreUnavailableError) as info:
        await health.call(frozen, DEADLINE_S, "HEAD k")
    assert "did not answer within" in str(info.value)
    assert not health.reachable and health.timeouts == 1
    # Without a circuit, the same deadline still holds.
    with pytest.raises(ObjectStoreUnavailableError):
        await bounded(None, frozen, DEADLINE_S, "HEAD k")


def test_the_circuit_logs_once_per_outage(caplog: pytest.LogCaptureFixture) -> None:
    health = StoreHealth(FakeClock())
    with caplog.at_level(logging.INFO):
        for _ in range(50):
            health.record_failure(TimeoutError())
        health.record_success()
    lines = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 2, [r.getMessage() for r in lines]


# ------------------------------------------------------------------------------------------ reads
async def test_cached_blocks_are_served_and_uncached_reads_fail_at_once_while_unreachable() -> None:
    inner = InMemoryObjectStore()
    info = inner.put_object("f", b"x" * (3 * BS))
    store = FailingObjectStore(inner)
    health = StoreHealth(FakeClock())
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=16 * BS, fetch_timeout_s=DEADLINE_S * 4),
                       store, RamTier(16 * BS), health=health)
    ref = ObjectRef("f", info.etag, info.size)
    assert await cache.read(ref, 0, BS) == b"x" * BS  # block 0 cached
    store.delay_s = FROZEN_S
    with pytest.raises(ObjectStoreUnavailableError) as exc:
        await cache.read(ref, BS, BS)  # the GET hangs: the fetch deadline fails it
    assert exc.value.errno == errno.EIO and not health.reachable
    gets = store.stats.get_requests
    assert await cache.read(ref, 0, BS) == b"x" * BS
    with pytest.raises(ObjectStoreUnavailableError):
        await cache.read(ref, 2 * BS, BS)
    assert store.stats.get_requests == gets, "no GET is sent while the store is unreachable"
    await health.close()


# ------------------------------------------------------------------------------------------ metadata
def make_fs(store: FailingObjectStore, clock: FakeClock, health: StoreHealth) -> CacheFS:
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=16 * BS, fetch_timeout_s=1.0), store,
                       RamTier(16 * BS), health=health)
    settings = FsSettings(attr_ttl_s=1, dir_ttl_s=1, read_only=True, metadata_timeout_s=DEADLINE_S)
    return CacheFS(store, cache, settings, clock=clock)


async def test_open_and_read_within_the_ttl_need_no_store_round_trip() -> None:
    inner = InMemoryObjectStore()
    inner.put_object("d/a", b"aaa")
    store = FailingObjectStore(inner)
    clock = FakeClock()
    health = StoreHealth(clock)
    fs = make_fs(store, clock, health)
    d = await fs.lookup(ROOT_INODE, b"d")
    a = await fs.lookup(d.inode, b"a")
    fh, _ = await fs.open(a.inode, os.O_RDONLY)
    assert bytes(await fs.read(fh, 0, 3)) == b"aaa"
    fs.release(fh)
    before = store.stats.requests
    store.delay_s = FROZEN_S  # any store call would now time out and open the circuit
    assert (await fs.lookup(d.inode, b"a")).size == 3
    assert (await fs.getattr(a.inode)).size == 3
    fh, _ = await fs.open(a.inode, os.O_RDONLY)
    assert bytes(await fs.read(fh, 0, 3)) == b"aaa"
    fs.release(fh)
    assert store.stats.requests == before and health.reachable and health.timeouts == 0
    await health.close()


async def test_expired_metadata_is_served_stale_and_an_unlisted_directory_is_eio() -> None:
    inner = InMemoryObjectStore()
    inner.put_object("d/a", b"aaa")
    inner.put_object("e/b", b"bbb")
    store = FailingObjectStore(inner)
    clock = FakeClock()
    health = StoreHealth(clock)
    fs = make_fs(store, clock, health)
    d = await fs.lookup(ROOT_INODE, b"d")
    a = await fs.lookup(d.inode, b"a")
    fh, _ = await fs.open(a.inode, os.O_RDONLY)
    assert bytes(await fs.read(fh, 0, 3)) == b"aaa"
    fs.release(fh)
    e = await fs.lookup(ROOT_INODE, b"e")

    store.delay_s = FROZEN_S
    clock.advance(10)  # every TTL has expired
    assert (await fs.getattr(a.inode)).size == 3  # the LIST of d/ times out: stale listing
    assert not health.reachable and fs.stats.stale_listings_served == 1
    lists = store.stats.list_requests
    fh, _ = await fs.open(a.inode, os.O_RDONLY)
    assert bytes(await fs.read(fh, 0, 3)) == b"aaa"  # cached block, stale attributes
    fs.release(fh)
    entries = [entry.name for entry in fs.readdir(await fs.opendir(d.inode), 0)]
    assert entries == [b"a"]
    assert store.stats.list_requests == lists, "no LIST is sent while the store is unreachable"
    with pytest.raises(ObjectStoreUnavailableError):
        await fs.opendir(e.inode)  # never listed: nothing stale to serve
    fs.listings.forget("d")
    assert (await fs.getattr(a.inode)).size == 3  # no listing at all: the node's attributes
    assert fs.stats.stale_attributes_served == 1

    doc = stats_document(fs)
    assert doc["store_health"]["state"] == "unreachable" and doc["store_health"]["unreachable_for_s"] >= 0
    names = {family.name for family in metrics.CacheFSCollector(lambda: doc, lambda: {}).collect()}
    assert {metrics.STORE_REACHABLE, metrics.STORE_UNREACHABLE_SECONDS} <= names
    await health.close()


# ------------------------------------------------------------------------------------------ write-back
async def test_an_upload_stuck_on_a_frozen_store_times_out_and_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wb_settings, "UPLOAD_TIMEOUT_FLOOR_S", DEADLINE_S)
    inner = InMemoryObjectStore()
    store = FailingObjectStore(inner, write_delay_s=FROZEN_S)
    health = StoreHealth(FakeClock(), probe=store.check, probe_interval_s=0.01)
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=16 * BS), store, RamTier(16 * BS), health=health)
    wb = WriteBack(WriteBackSettings(upload_delay_s=0, space_wait_s=0.2), tmp_path / "staging", store, cache,
                   InMemoryBudget(64 * 1024 * 1024), rng=random.Random(1), health=health)
    await wb.start()
    try:
        sf = await wb.create("k", may_exist=False)
        wb.hold(sf)
        await wb.write(sf, 0, b"payload")
        await wb.commit(sf)  # write-back: staged at local speed, whatever the store does
        report = await wb.flush(0.5)
        assert not report.ok and wb.stats.failed_attempts >= 1 and not health.reachable
        assert not wb.uploader.running or all(not t.done() for t in wb.uploader.running)
        # A retry that started frozen (the flush above can return late on a loaded machine) fails at its
        # deadline and backs off again: the store comes back only once no attempt is in flight, so the
        # flush below times the retry of a store that answers, not the backoff of one more failure.
        deadline = time.monotonic() + 5
        while wb.uploader.busy("k"):
            assert time.monotonic() < deadline, "the frozen attempt outlived its deadline"
            await asyncio.sleep(0.01)
        store.write_delay_s = 0
        health.clock.advance(1)  # type: ignore[attr-defined]
        report = await wb.flush(5)
        assert report.ok, report.pending
        assert inner._objects["k"].data == b"payload" and health.reachable
    finally:
        await wb.stop()
        await health.close()


# ------------------------------------------------------------------------------------------ S3, frozen
async def test_the_s3_store_honours_the_request_deadline_on_a_silent_endpoint() -> None:
    """A listener on 127.0.0.1 that accepts and never answers: a LIST under ``request_deadline``
    fails as unreachable, a GET under the circuit's deadline too, and the store closes cleanly."""
    from tiering.objectstore.s3 import S3ObjectStore
    from tiering.storehealth import request_deadline

    held: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    environ = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}
    store = S3ObjectStore("bucket", endpoint_url=f"http://127.0.0.1:{port}", environ=environ)
    health = StoreHealth(FakeClock())
    try:
        with request_deadline(0.2), pytest.raises(ObjectStoreUnavailableError) as info:
            await store.list_dir("")
        assert info.value.errno == errno.EIO
        with pytest.raises(ObjectStoreUnavailableError):
            await health.call(lambda: store.get_range("k", '"etag"', 0, 10), 0.3, "reading 'k'")
        assert not health.reachable and health.timeouts == 1
    finally:
        await asyncio.wait_for(store.close(), 10)
        for writer in held:
            writer.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), 10)
