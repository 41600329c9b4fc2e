"""The daemon-wide statistics document: ``GET /stats``, ``cachefs stats --json`` and ``/metrics``.

One document for the whole mount, read from the counters where the events happen: the tiers, the
engine, the object store, the filesystem's tables and counters, and write-back. Nothing here counts;
it is built on request, so the JSON and the Prometheus view (``cachefs.daemon.metrics``, which reads
this same document) can never disagree.
"""

from __future__ import annotations

from typing import Any

from cachefs.daemon.heap import heap_stats
from cachefs.fs.filesystem import CacheFS
from cachefs.fuse.wire import OPCODE_NAMES
from tiering.engine.blockcache import BlockCache
from tiering.protocols import ObjectStoreStats


def cluster_section(cache: BlockCache) -> dict[str, Any]:
    """The cluster tier's counters, in the names the local tiers use where they mean the same."""
    assert cache.cluster is not None
    st = cache.cluster.stats
    section: dict[str, Any] = {
        **cache.cluster.snapshot(),
        "hits": st.hits,
        "misses": st.misses,
        "hit_bytes": st.hit_bytes,
        "errors": st.errors,
        "corrupt_blocks": st.corrupt_blocks,
        "forged_blocks": st.forged_blocks,
        "stale_blocks": st.stale_blocks,
        "skipped": st.skipped,
        "inserts": st.puts,
        "inserted_bytes": st.put_bytes,
        "served_blocks": cache.stats.cluster_served,
        "served_bytes": cache.stats.cluster_served_bytes,
        # Source requests proving this volume may read what the cluster tier holds (one per object
        # version and daemon), and the hits refused because the source said no.
        "authorization_requests": cache.stats.cluster_authorizations,
        "authorization_refused": cache.stats.cluster_refused,
    }
    if cache.write_behind is not None:
        section["write_behind"] = cache.write_behind.snapshot()
    return section


def store_traffic(stats: ObjectStoreStats) -> dict[str, int]:
    """What one store (the source, or the cluster store) was sent and gave: all requests, the reads
    (GETs and their bytes) and the uploads (PUTs, multipart parts included, and their bytes)."""
    return {
        "requests": stats.requests,
        "read_requests": stats.get_requests,
        "read_bytes": stats.bytes_read,
        "upload_requests": stats.put_requests,
        "uploaded_bytes": stats.bytes_written,
    }


def traffic_section(cache: BlockCache, source: ObjectStoreStats) -> dict[str, Any]:
    """Where reads were answered (``tiering.traffic``: bytes and block requests per place, what did
    not reach the source, hit ratios by bytes) and what the source and the cluster store were sent."""
    return {
        **cache.traffic.snapshot(),
        "source": store_traffic(source),
        **({"cluster_store": store_traffic(cache.cluster.store_stats)} if cache.cluster is not None else {}),
    }


def stats_document(fs: CacheFS, volume: str = "") -> dict[str, Any]:
    """The document ``GET /stats`` serves and ``cachefs stats --json`` prints.

    ``volume`` names the mount in the per-volume metrics (``MountSettings.source_label``: the same
    value on every node that mounts the same source, one value per daemon)."""
    cache = fs.cache
    tiers: dict[str, Any] = {}
    disk = cache.disk
    for tier in (cache.ram, disk):
        if tier is None:
            continue
        st = tier.stats
        entry: dict[str, Any] = {
            "used_bytes": tier.used_bytes(),
            "capacity_bytes": tier.capacity_bytes,
            "entries": len(tier),
            "hits": st.hits,
            "misses": st.misses,
            "hit_bytes": st.hit_bytes,
            "inserts": st.inserts,
            "evictions": st.evictions,
            "evicted_bytes": st.evicted_bytes,
            "errors": st.errors,
            "corrupt_blocks": st.corrupt_blocks,
            "ordered_evictions": st.ordered_evictions,
        }
        # Bytes reads had to load from below this tier because it missed (see EngineStats).
        entry["miss_bytes"] = (cache.stats.ram_miss_bytes if tier is cache.ram
                               else cache.stats.disk_miss_bytes)
        if disk is not None and tier is disk:  # pins and health are the disk tier's (DiskBlockTier)
            entry["pinned_bytes"] = disk.pinned_bytes()
            entry["state"] = disk.health.state
        tiers[tier.name] = entry
    store = fs.store.stats
    engine = cache.stats
    traffic = traffic_section(cache, store)
    return {
        "volume": volume,
        # Savings: reads by the place that answered them, and what each store was sent.
        "traffic": traffic,
        "tiers": tiers,
        "object_store": {
            "requests": store.requests,
            "bytes_read": store.bytes_read,
            "errors": store.errors,
            "get_requests": store.get_requests,
            "list_requests": store.list_requests,
            "head_requests": store.head_requests,
            "put_requests": store.put_requests,
            "delete_requests": store.delete_requests,
            "copy_requests": store.copy_requests,
            "bytes_written": store.bytes_written,
        },
        # The store-health circuit (tiering.storehealth): reachable or not, and for how long.
        **({"store_health": cache.health.snapshot()} if cache.health is not None else {}),
        # The one hit ratio (docs/statistics.md): the share of bytes read that did not come from the source.
        "hit_ratio": traffic["hit_ratio"],
        "blocks": {
            "block_size": cache.block_size,
            "requests": engine.block_requests,
            "ram_served": engine.ram_served,
            "disk_served": engine.disk_served,
            "cluster_served": engine.cluster_served,
            "fetched": engine.store_fetches,
            "fetched_bytes": engine.store_fetch_bytes,
            "fetch_errors": engine.fetch_errors,
            "readahead_blocks": engine.readahead_blocks,
            "readahead_bytes": engine.readahead_bytes,
            "singleflight_joins": engine.singleflight_joins,
            # Blocks being received, counted against the RAM tier (tiering.engine.inflight), and
            # the loads that waited for that memory.
            "in_flight_bytes": cache.loads.inflight.reserved_bytes,
            "in_flight_limit_bytes": cache.loads.inflight.limit_bytes,
            "memory_waits": cache.loads.inflight.waits,
            "dropped_blocks": engine.dropped_blocks,
            "dropped_bytes": engine.dropped_bytes,
        },
        # Warming the disk tier (what cachefs prefetch jobs do), pinned objects, request latency.
        "warm": {
            "blocks": engine.warm_blocks,
            "bytes": engine.warm_bytes,
            "from_ram_blocks": engine.warm_from_ram_blocks,
            "from_cluster_blocks": engine.warm_from_cluster_blocks,
            "skipped_blocks": engine.warm_skipped_blocks,
            "skipped_bytes": engine.warm_skipped_bytes,
            "not_stored_blocks": engine.warm_not_stored,
        },
        "pins": cache.pin_stats(),
        "latency": {op: hist.snapshot() for op, hist in cache.latency.items()},
        # The collector (cachefs.daemon.heap): start-up's objects frozen, collections per generation.
        "process": heap_stats(),
        "filesystem": {
            "inodes": len(fs.inodes),
            "open_handles": len(fs.handles),
            "cached_listings": len(fs.listings),
            "cached_listing_entries": fs.listings.entry_count,
            "lookups": fs.stats.lookups,
            "listings": fs.stats.listings,
            "listing_errors": fs.stats.listing_errors,
            "stale_listings_served": fs.stats.stale_listings_served,
            "index_listings": fs.stats.index_listings,
            "index_errors": fs.stats.index_errors,
            "index_entries": fs.listings.index.total_entries if fs.listings.index is not None else 0,
            "mtime_heads": fs.stats.mtime_heads,
            "stale_attributes_served": fs.stats.stale_attributes_served,
            "opens": fs.stats.opens,
            "opens_waited": fs.stats.opens_waited,
            "stale_opens": fs.stats.stale_opens,
            "retried_opens_kept": fs.stats.retried_opens_kept,
            "retried_opens_stale": fs.stats.retried_opens_stale,
            "reads": fs.stats.reads,
            "read_bytes": fs.stats.read_bytes,
            "skipped_keys": fs.stats.skipped_keys,
            "writes": fs.stats.writes,
            "write_bytes": fs.stats.write_bytes,
            "creates": fs.stats.creates,
            "unlinks": fs.stats.unlinks,
            "mkdirs": fs.stats.mkdirs,
            "rmdirs": fs.stats.rmdirs,
            "renames": fs.stats.renames,
            "truncates": fs.stats.truncates,
            "fallocates": fs.stats.fallocates,
            "fsyncs": fs.stats.fsyncs,
            "flushes": fs.stats.flushes,
        },
        # Kernel passthrough (cachefs.fuse.adapter): whether this connection uses it, the opens the
        # kernel reads by itself (no READ reaches the daemon for them), and the whole files on the
        # disk tier it reads (tiering.tiers.wholefile; counted in the disk tier's used bytes).
        "fuse": {
            "passthrough": fs.stats.passthrough_active,
            "passthrough_opens": fs.stats.passthrough_opens,
            "passthrough_refused": fs.stats.passthrough_refused,
            "passthrough_fallbacks": fs.stats.passthrough_fallbacks,
            # Backing files registered with the kernel (once per inode and version: kept between opens)
            # and the ids registered now.
            "backing_registrations": fs.stats.backing_registrations,
            "backing_ids": fs.stats.backing_ids,
            # Requests the kernel sent, by kind (what a warm file or a READ cost; INIT, LOOKUP, OPEN...).
            "requests": {OPCODE_NAMES.get(op, str(op)): n for op, n in enumerate(fs.stats.fuse_requests) if n},
            # Notifications that the kernel drop a name or inode changed in the bucket (a re-list saw
            # it): written, not held by the kernel (ENOENT: normal), refused, dropped unsent.
            "inval_entries": fs.stats.inval_entries,
            "inval_inodes": fs.stats.inval_inodes,
            "inval_not_cached": fs.stats.inval_not_cached,
            "inval_errors": fs.stats.inval_errors,
            "inval_dropped": fs.stats.inval_dropped,
            "whole_files": fs.whole.store.whole_snapshot() if fs.whole is not None else {},
        },
        # The shared cluster tier (tiering.tiers.cluster) and its write-behind queue; absent without one.
        **({"cluster": cluster_section(cache)} if cache.cluster is not None else {}),
        # Announced read orders (tiering.policy.readorder): files, stalls, the window fetched ahead.
        # Evictions ranked by the order are each tier's "ordered_evictions".
        **({"announce": fs.read_order.snapshot()} if fs.read_order is not None else {}),
        # Staged writes and their uploads (tiering.writeback); absent on a read-only mount.
        **({"writeback": fs.writeback.stats_snapshot()} if fs.writeback is not None else {}),
    }
