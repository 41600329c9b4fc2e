"""/metrics: every family is built from the stats document at scrape time and follows the conventions."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachefs.daemon import metrics
from cachefs.daemon.control import ControlServer
from cachefs.daemon.stats import stats_document
from cachefs.fs.filesystem import CacheFS
from cachefs.fs.inodes import ROOT_INODE
from cachefs.settings import FsSettings
from tiering.blocks import MIN_BLOCK_SIZE, ObjectRef
from tiering.tiers.disk import DiskTier
from tiering.engine.blockcache import BlockCache
from tiering.objectstore.memory import FailingObjectStore, InMemoryObjectStore
from tiering.tiers.ram import RamTier
from tiering.settings import CacheSettings
from tiering.writeback import WriteBack, WriteBackSettings

BS = MIN_BLOCK_SIZE


@pytest.fixture
async def fs(tmp_path: Path) -> CacheFS:
    store = InMemoryObjectStore()
    info = store.put_object("d/f.bin", b"z" * (3 * BS))
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=8 * BS, disk_bytes=64 * BS), store,
                       RamTier(8 * BS), DiskTier(tmp_path / "c", 64 * BS))
    filesystem = CacheFS(store, cache, FsSettings())
    ref = ObjectRef(info.key, info.etag, info.size)
    await cache.read(ref, 0, ref.size)
    await cache.read(ref, 0, ref.size)
    await cache.close()  # the loads' disk writes are done
    await cache.warm(ref)
    await filesystem.lookup(1, b"d")
    return filesystem


def families(fs: CacheFS) -> dict:
    registry = metrics.make_registry(lambda: stats_document(fs), lambda: fs.cache.latency)
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family, **labels) -> float:
    for sample in family.samples:
        if all(sample.labels.get(k) == v for k, v in labels.items()) and not sample.name.endswith("_created"):
            return sample.value
    raise AssertionError(f"no sample {labels} in {family.name}")


def test_every_name_is_a_constant_and_follows_the_conventions() -> None:
    names = [v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str) and v.startswith("cachefs_")]
    assert len(names) == len(set(names)) >= 40
    for name in names:
        assert name == name.lower() and " " not in name
        assert not name.endswith("_total_total")


async def test_metrics_parse_and_match_the_stats_document(fs: CacheFS) -> None:
    got = families(fs)
    snap = stats_document(fs)
    # Counters: the parser strips "_total" from the family name; samples keep it.
    counters = {n for n, f in got.items() if f.type == "counter"}
    for name in (metrics.TIER_HITS_TOTAL, metrics.TIER_MISSES_TOTAL, metrics.TIER_HIT_BYTES_TOTAL,
                 metrics.TIER_MISS_BYTES_TOTAL, metrics.TIER_EVICTIONS_TOTAL, metrics.STORE_REQUESTS_TOTAL,
                 metrics.STORE_ERRORS_TOTAL, metrics.WARM_BYTES_TOTAL, metrics.FETCH_ERRORS_TOTAL):
        assert name.removesuffix("_total") in counters, name
    for tier in ("ram", "disk"):
        assert value(got["cachefs_tier_hits"], tier=tier) == snap["tiers"][tier]["hits"]
        assert value(got["cachefs_tier_misses"], tier=tier) == snap["tiers"][tier]["misses"]
        assert value(got[metrics.TIER_USED_BYTES], tier=tier) == snap["tiers"][tier]["used_bytes"]
        assert value(got[metrics.TIER_CAPACITY_BYTES], tier=tier) == snap["tiers"][tier]["capacity_bytes"]
        assert got[metrics.TIER_USED_BYTES].type == "gauge"
    assert value(got["cachefs_tier_miss_bytes"], tier="ram") == 3 * BS  # one fetch of each block
    assert value(got[metrics.TIER_STATE], tier="disk", state="healthy") == 1.0
    assert value(got["cachefs_object_store_requests"], operation="get") == snap["object_store"]["get_requests"] == 3
    assert value(got["cachefs_object_store_requests"], operation="list") == 1
    assert value(got["cachefs_blocks_served"], tier="ram") == snap["blocks"]["ram_served"]
    assert value(got["cachefs_warm_bytes"]) == snap["warm"]["bytes"]
    assert value(got["cachefs_warm_skipped_bytes"]) == 3 * BS  # warm found them on disk
    assert value(got[metrics.PINNED_BYTES]) == 0
    assert value(got[metrics.PIN_LIMIT_BYTES]) == snap["pins"]["limit_bytes"] == 32 * BS
    hist = got[metrics.STORE_REQUEST_DURATION_SECONDS]
    assert hist.type == "histogram"
    count = [s for s in hist.samples if s.name.endswith("_count") and s.labels["operation"] == "get"]
    assert count[0].value == 3
    inf = [s for s in hist.samples if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert inf[0].value == 3
    assert "process_resident_memory_bytes" in got or "process_cpu_seconds" in got


async def test_writeback_series_follow_the_writeback_snapshot(tmp_path: Path) -> None:
    """Dirty data, uploads, failures, oldest dirty age, store state and staging space (issue 12)."""
    inner = InMemoryObjectStore()
    store = FailingObjectStore(inner, fail_writes=True)
    disk = DiskTier(tmp_path / "c", 64 * BS)
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=8 * BS, disk_bytes=64 * BS), store, RamTier(8 * BS), disk)
    filesystem = CacheFS(store, cache, FsSettings())
    wall = [1_700_000_000.0]
    wb = WriteBack(WriteBackSettings(upload_delay_s=0.0), tmp_path / "c" / "staging", store, cache, disk,
                   wall=lambda: wall[0])
    filesystem.attach_writeback(wb)
    await wb.start()
    try:
        fh, _, _ = await filesystem.create(ROOT_INODE, b"f.bin", 0o644, os.O_CREAT | os.O_WRONLY)
        await filesystem.write(fh, 0, b"12345")
        await filesystem.flush(fh)
        filesystem.release(fh)
        wall[0] += 30
        assert not (await wb.flush(0.2)).ok  # the store refuses writes

        got = families(filesystem)
        snap = stats_document(filesystem)["writeback"]
        assert value(got[metrics.DIRTY_BYTES]) == snap["dirty_bytes"] == 5
        assert value(got[metrics.DIRTY_FILES]) == snap["dirty_files"] == 1
        assert value(got[metrics.WRITEBACK_PENDING_OPERATIONS]) == snap["pending_operations"] == 1
        assert value(got[metrics.OLDEST_DIRTY_AGE_SECONDS]) == snap["oldest_dirty_age_s"] == 30
        assert value(got[metrics.UPLOADS_IN_FLIGHT]) == snap["uploads_in_flight"]
        failures = value(got["cachefs_upload_failures"])
        assert failures == snap["failed_attempts"] >= 1
        assert got["cachefs_upload_failures"].type == "counter"
        assert value(got[metrics.WRITEBACK_STORE_STATE], state="unreachable") == 1.0
        assert value(got[metrics.WRITEBACK_STORE_STATE], state="ok") == 0.0
        assert value(got[metrics.STAGING_USED_BYTES]) == snap["staged_bytes"] > 0
        assert value(got[metrics.STAGING_LIMIT_BYTES]) == snap["staging_limit_bytes"] == 64 * BS
        assert value(got["cachefs_uploads"]) == 0

        store.fail_writes = False
        wb.poke()
        assert (await wb.flush(5)).ok
        got = families(filesystem)
        assert value(got["cachefs_uploads"]) == 1 and value(got["cachefs_uploaded_bytes"]) == 5
        assert value(got[metrics.DIRTY_BYTES]) == 0 and value(got[metrics.OLDEST_DIRTY_AGE_SECONDS]) == 0
        assert value(got[metrics.WRITEBACK_STORE_STATE], state="ok") == 1.0
        assert value(got[metrics.WRITEBACK_STORE_STATE], state="unreachable") == 0.0
        assert value(got["cachefs_upload_failures"]) == failures  # a counter never goes back
    finally:
        await wb.stop()


async def test_a_read_only_mount_has_no_writeback_series(fs: CacheFS) -> None:
    got = families(fs)
    assert "writeback" not in stats_document(fs)
    assert metrics.DIRTY_BYTES not in got and metrics.WRITEBACK_STORE_STATE not in got


async def test_metrics_route_is_public(fs: CacheFS, tmp_path: Path) -> None:
    control = ControlServer(tmp_path / "c.sock", lambda: stats_document(fs), {})
    control.add_route("GET", "/metrics", metrics.metrics_handler(
        metrics.make_registry(lambda: stats_document(fs), lambda: fs.cache.latency)), public=True)
    await control.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{control.tcp_port}/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
        assert "cachefs_tier_hits_total{tier=\"ram\"}" in text
    finally:
        await control.stop()


async def test_the_cluster_tier_is_reported_with_tier_cluster(tmp_path: Path) -> None:
    from tiering.tiers.cluster import InMemoryClusterTier, WriteBehind

    store = InMemoryObjectStore()
    info = store.put_object("d/f.bin", b"z" * (3 * BS))
    cluster = InMemoryClusterTier()
    queue = WriteBehind(cluster, max_blocks=1, max_bytes=BS, workers=1)
    cache = BlockCache(CacheSettings(block_size=BS, ram_bytes=8 * BS, disk_bytes=64 * BS), store,
                       RamTier(8 * BS), DiskTier(tmp_path / "c", 64 * BS), cluster=cluster, write_behind=queue)
    filesystem = CacheFS(store, cache, FsSettings())
    await cache.read(ObjectRef(info.key, info.etag, info.size), 0, info.size)
    await cache.close()
    snap = stats_document(filesystem)["cluster"]
    assert snap["misses"] == 3 and snap["state"] == "healthy"
    # The queue (one block) was full for two of them: read back from the disk tier and uploaded later.
    assert snap["write_behind"]["written"] == 3 and snap["write_behind"]["dropped"] == 0
    got = families(filesystem)
    assert value(got["cachefs_tier_misses"], tier="cluster") == 3
    assert value(got["cachefs_tier_inserts"], tier="cluster") == snap["inserts"]
    assert value(got["cachefs_tier_write_behind_deferred"], tier="cluster") == snap["write_behind"]["deferred"] >= 1
    assert value(got["cachefs_tier_write_behind_caught_up"], tier="cluster") == snap["write_behind"]["deferred"]
    assert value(got["cachefs_tier_write_behind_gone"], tier="cluster") == 0
    assert value(got["cachefs_tier_write_behind_present"], tier="cluster") == 0
    assert value(got["cachefs_tier_write_behind_dropped"], tier="cluster") == 0
    assert value(got[metrics.TIER_WRITE_BEHIND_DEPTH], tier="cluster") == 0
    assert value(got[metrics.TIER_STATE], tier="cluster", state="healthy") == 1
    assert value(got["cachefs_blocks_served"], tier="cluster") == 0


async def test_per_volume_series_follow_the_traffic_section(fs: CacheFS) -> None:
    """What the cache saved, per volume (issue 26): served bytes per tier, the source's requests."""
    registry = metrics.make_registry(lambda: stats_document(fs, "ab12"), lambda: fs.cache.latency, process=False)
    got = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    traffic = stats_document(fs, "ab12")["traffic"]
    # The fixture read 3 blocks cold (source), then again (RAM); the warm served no read.
    assert value(got["cachefs_volume_served_bytes"], volume="ab12", tier="source") == 3 * BS
    assert value(got["cachefs_volume_served_bytes"], volume="ab12", tier="ram") == 3 * BS
    assert value(got["cachefs_volume_served_blocks"], volume="ab12", tier="disk") == 0
    assert value(got["cachefs_volume_avoided_source_bytes"], volume="ab12") == traffic["avoided_source_bytes"] == 3 * BS
    assert value(got["cachefs_volume_avoided_source_requests"], volume="ab12") == 3
    assert value(got["cachefs_volume_store_requests"], volume="ab12", store="source", direction="read") == 3
    assert value(got["cachefs_volume_store_bytes"], volume="ab12", store="source", direction="read") == 3 * BS
    assert value(got["cachefs_volume_store_bytes"], volume="ab12", store="source", direction="upload") == 0
    assert value(got[metrics.VOLUME_HIT_RATIO], volume="ab12", scope="local") == 0.5
    assert not [s for s in got["cachefs_volume_store_requests"].samples if s.labels["store"] == "cluster"]


async def test_one_hit_ratio_in_stats_metrics_the_dataset_and_the_dashboard(fs: CacheFS) -> None:
    """Issue 37, item 6: one hit ratio, defined in docs/statistics.md (the share of the bytes read that
    did not come from the source), the same in ``cachefs stats`` (``hit_ratio``), ``/metrics``
    (``cachefs_hit_ratio``, ``cachefs_volume_hit_ratio{scope="all"}``), the Dataset's HIT RATIO column
    and the dashboard's hit-ratio panel. Two different ratios (60.5% and 61.7%) stood on one screen."""
    import json
    import re

    from csi_driver.operator.usage import COUNTERS, Prices, display, savings
    from tiering.units import format_size

    doc = stats_document(fs, "ab12")
    traffic = doc["traffic"]
    served = traffic["served_bytes"]
    expected = round((served["ram"] + served["disk"] + served["cluster"]) / sum(served.values()), 6)
    assert doc["hit_ratio"] == traffic["hit_ratio"] == expected == 0.5
    got = families(fs)
    assert value(got[metrics.HIT_RATIO]) == expected
    registry = metrics.make_registry(lambda: stats_document(fs, "ab12"), lambda: fs.cache.latency, process=False)
    volume = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert value(volume[metrics.VOLUME_HIT_RATIO], volume="ab12", scope="all") == expected
    totals = {name: int(traffic.get(section, {}).get(key, 0)) for name, (section, key) in COUNTERS.items()}
    assert display(savings(totals, Prices()), format_size)["hitRatio"] == f"{expected:.1%}"
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy/dashboards/cachefs.json").read_text())
    [panel] = [p for p in dashboard["panels"] if p.get("title") == "Hit ratio"]
    [target] = [t for t in panel["targets"] if t["legendFormat"] == "hit ratio"]
    numerator, denominator = target["expr"].split(" / ")
    assert 'tier!="source"' in numerator and "tier" not in denominator.replace("tier!=", "")
    assert re.sub(r',\s*tier!="source"', "", numerator) == denominator
    docs = (Path(__file__).resolve().parents[2] / "docs/statistics.md").read_text()
    assert "## The hit ratio" in docs and "did not come from the source" in docs
