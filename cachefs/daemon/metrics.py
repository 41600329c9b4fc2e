"""Prometheus metrics of one mount (``GET /metrics``), and every metric name, in one place.

No double bookkeeping: nothing here counts anything. The daemon's counters live where the events
happen (tier stats, engine stats, object-store stats, filesystem stats, the engine's latency
histograms), and ``CacheFSCollector`` turns them into metric families *at scrape time*, from the
same document (``cachefs.daemon.stats``) that ``/stats`` and ``cachefs stats --json`` serve, so the
two views can never disagree. The latency histograms come from ``tiering.latency`` (fixed buckets,
recorded by the engine without knowing Prometheus) and are exported as Prometheus histograms.

Conventions (https://prometheus.io/docs/practices/naming/): every name starts with ``cachefs_``;
counters end in ``_total``; sizes are in bytes and end in ``_bytes``; durations are in seconds.
Per-tier series carry a ``tier`` label (``ram``, ``disk``, ``cluster`` for the shared cluster tier;
``object_store`` where a block was served
by a fetch), object-store requests an ``operation`` label (``get``, ``list``, ``head``, and whatever
other ``<op>_requests`` counter the store reports, so new operations appear without a change here).
The registry is private to the mount (not the process-global default one) and also carries the
standard ``process_*`` metrics (memory, CPU, open files) of the daemon.

``/metrics``, ``/stats`` and ``/healthz`` are public routes: served on the control socket and, with
``--stats-addr``, on TCP. They are read-only views; nothing that changes the cache is on TCP.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cachefs.daemon.context import DaemonContext
from cachefs.daemon.stats import stats_document
from tiering.latency import LatencyHistogram
from tiering.writeback.report import STORE_STATES

# ---------------------------------------------------------------------------------------- names
# Per tier (label "tier": ram, disk).
TIER_HITS_TOTAL = "cachefs_tier_hits_total"
TIER_MISSES_TOTAL = "cachefs_tier_misses_total"
TIER_HIT_BYTES_TOTAL = "cachefs_tier_hit_bytes_total"
TIER_MISS_BYTES_TOTAL = "cachefs_tier_miss_bytes_total"
TIER_INSERTS_TOTAL = "cachefs_tier_inserts_total"
TIER_EVICTIONS_TOTAL = "cachefs_tier_evictions_total"
TIER_EVICTED_BYTES_TOTAL = "cachefs_tier_evicted_bytes_total"
TIER_ERRORS_TOTAL = "cachefs_tier_errors_total"
TIER_CORRUPT_BLOCKS_TOTAL = "cachefs_tier_corrupt_blocks_total"
TIER_USED_BYTES = "cachefs_tier_used_bytes"
TIER_CAPACITY_BYTES = "cachefs_tier_capacity_bytes"
TIER_ENTRIES = "cachefs_tier_entries"
TIER_STATE = "cachefs_tier_state"  # labels tier, state; 1 for the current state (disk tier health)
TIER_STATES = ("healthy", "unstable", "down")
# The shared cluster tier (tier="cluster"): the counters above where they mean the same (hits,
# misses, hit bytes, inserts, errors, corrupt blocks, state), and its write-behind queue.
TIER_FORGED_BLOCKS_TOTAL = "cachefs_tier_forged_blocks_total"  # cluster frames whose MAC failed
TIER_AUTHORIZATION_REQUESTS_TOTAL = "cachefs_tier_authorization_requests_total"  # source one-byte GETs before a hit
TIER_AUTHORIZATION_REFUSED_TOTAL = "cachefs_tier_authorization_refused_total"  # hits the source refused
TIER_WRITE_BEHIND_DEPTH = "cachefs_tier_write_behind_depth"  # blocks waiting (queued, deferred) or uploading
TIER_WRITE_BEHIND_BYTES = "cachefs_tier_write_behind_bytes"  # bytes held in memory for them
TIER_WRITE_BEHIND_WRITTEN_TOTAL = "cachefs_tier_write_behind_written_total"
TIER_WRITE_BEHIND_DROPPED_TOTAL = "cachefs_tier_write_behind_dropped_total"  # neither queued nor deferred
TIER_WRITE_BEHIND_DEFERRED_TOTAL = "cachefs_tier_write_behind_deferred_total"  # queue full: read back from disk later
TIER_WRITE_BEHIND_CAUGHT_UP_TOTAL = "cachefs_tier_write_behind_caught_up_total"  # deferred, read back, handed up
TIER_WRITE_BEHIND_GONE_TOTAL = "cachefs_tier_write_behind_gone_total"  # deferred, off the disk tier by then
TIER_WRITE_BEHIND_PRESENT_TOTAL = "cachefs_tier_write_behind_present_total"  # deferred, stored by another node
TIER_INSERTED_BYTES_TOTAL = "cachefs_tier_inserted_bytes_total"
# Object store (label "operation" on requests and latency).
# Evictions by the policy that chose the victims: "lru", or "announced" (farthest next use in an
# announced read order, tiering.policy.victims).
TIER_EVICTIONS_BY_POLICY_TOTAL = "cachefs_tier_evictions_by_policy_total"  # labels tier, policy
# Announced read orders (cachefs.daemon.announce).
ANNOUNCED_FILES_TOTAL = "cachefs_announced_files_total"
ANNOUNCED_BYTES_TOTAL = "cachefs_announced_bytes_total"
ANNOUNCE_ORDER_HITS_TOTAL = "cachefs_announce_order_hits_total"  # opens of announced files found cached
ANNOUNCE_STALLS_TOTAL = "cachefs_announce_stalls_total"  # opens of announced files that waited for a block
ANNOUNCE_PREFETCHED_BLOCKS_TOTAL = "cachefs_announce_prefetched_blocks_total"
ANNOUNCE_WINDOW_BYTES = "cachefs_announce_window_bytes"  # bytes fetched ahead of the readers now
ANNOUNCE_STREAMS = "cachefs_announce_streams"

STORE_REQUESTS_TOTAL = "cachefs_object_store_requests_total"
STORE_READ_BYTES_TOTAL = "cachefs_object_store_read_bytes_total"
STORE_ERRORS_TOTAL = "cachefs_object_store_errors_total"
STORE_REQUEST_DURATION_SECONDS = "cachefs_object_store_request_duration_seconds"
# The store-health circuit (tiering.storehealth), exported when the stats document has "store_health".
STORE_REACHABLE = "cachefs_object_store_reachable"  # 1 reachable, 0 unreachable (circuit open)
STORE_UNREACHABLE_SECONDS = "cachefs_object_store_unreachable_seconds"  # how long the outage has lasted
STORE_OUTAGES_TOTAL = "cachefs_object_store_outages_total"
STORE_TIMEOUTS_TOTAL = "cachefs_object_store_timeouts_total"  # calls whose deadline passed
STORE_SHORT_CIRCUITED_TOTAL = "cachefs_object_store_short_circuited_total"  # failed at once, circuit open
STALE_METADATA_SERVED_TOTAL = "cachefs_stale_metadata_served_total"  # label "kind": listing, attributes
# Block cache.
BLOCK_REQUESTS_TOTAL = "cachefs_block_requests_total"
BLOCKS_SERVED_TOTAL = "cachefs_blocks_served_total"  # label "tier": ram, disk, object_store
FETCH_ERRORS_TOTAL = "cachefs_fetch_errors_total"
READAHEAD_BYTES_TOTAL = "cachefs_readahead_bytes_total"
SINGLEFLIGHT_JOINS_TOTAL = "cachefs_singleflight_joins_total"
IN_FLIGHT_BYTES = "cachefs_in_flight_bytes"
MEMORY_WAITS_TOTAL = "cachefs_memory_waits_total"
DROPPED_BYTES_TOTAL = "cachefs_dropped_bytes_total"  # dropped on request (cachefs evict)
HIT_RATIO = "cachefs_hit_ratio"
# Warming the disk tier (what cachefs prefetch jobs do) and pins.
WARM_BYTES_TOTAL = "cachefs_warm_bytes_total"  # fetched from the store into the disk tier
WARM_BLOCKS_TOTAL = "cachefs_warm_blocks_total"
WARM_SKIPPED_BYTES_TOTAL = "cachefs_warm_skipped_bytes_total"  # already on disk
WARM_NOT_STORED_BLOCKS_TOTAL = "cachefs_warm_not_stored_blocks_total"
PINNED_BYTES = "cachefs_pinned_bytes"  # pinned blocks on the disk tier now
PINNED_DECLARED_BYTES = "cachefs_pinned_declared_bytes"  # footprint of every pinned object, cached or not
PINNED_OBJECTS = "cachefs_pinned_objects"
PIN_LIMIT_BYTES = "cachefs_pin_limit_bytes"
# Filesystem.
FS_OPERATIONS_TOTAL = "cachefs_fs_operations_total"  # label "operation": lookup, listing, open, read
FS_READ_BYTES_TOTAL = "cachefs_fs_read_bytes_total"
FS_LISTING_ERRORS_TOTAL = "cachefs_fs_listing_errors_total"
FS_SKIPPED_KEYS_TOTAL = "cachefs_fs_skipped_keys_total"
FS_INODES = "cachefs_fs_inodes"
FS_OPEN_HANDLES = "cachefs_fs_open_handles"
# Kernel passthrough (the "fuse" section): opens the kernel reads by itself, and the whole files it reads.
FUSE_PASSTHROUGH = "cachefs_fuse_passthrough"  # 1 when the connection uses passthrough
FUSE_PASSTHROUGH_OPENS_TOTAL = "cachefs_fuse_passthrough_opens_total"
FUSE_PASSTHROUGH_REFUSED_TOTAL = "cachefs_fuse_passthrough_refused_total"  # opens answered ETXTBSY
FUSE_PASSTHROUGH_FALLBACKS_TOTAL = "cachefs_fuse_passthrough_fallbacks_total"  # registrations refused
FUSE_BACKING_REGISTRATIONS_TOTAL = "cachefs_fuse_backing_registrations_total"  # backing files registered
FUSE_BACKING_IDS = "cachefs_fuse_backing_ids"  # backing ids registered now
FUSE_REQUESTS_TOTAL = "cachefs_fuse_requests_total"  # FUSE requests read, label opcode
# Notifications telling the kernel to drop an entry or inode that changed in the bucket.
FUSE_INVAL_ENTRIES_TOTAL = "cachefs_fuse_inval_entries_total"
FUSE_INVAL_INODES_TOTAL = "cachefs_fuse_inval_inodes_total"
FUSE_INVAL_NOT_CACHED_TOTAL = "cachefs_fuse_inval_not_cached_total"  # ENOENT: the kernel did not hold it
FUSE_INVAL_ERRORS_TOTAL = "cachefs_fuse_inval_errors_total"
FUSE_INVAL_DROPPED_TOTAL = "cachefs_fuse_inval_dropped_total"  # not sent: too many queued
WHOLE_FILES = "cachefs_whole_files"  # whole files on the disk tier now
WHOLE_FILE_BYTES = "cachefs_whole_file_bytes"
WHOLE_FILES_ASSEMBLED_TOTAL = "cachefs_whole_files_assembled_total"
# Write-back, exported when the stats document has a "writeback" section (a writable mount; dirty
# data is staged outside the block cache, in space shared with the disk tier).
DIRTY_BYTES = "cachefs_dirty_bytes"  # written, not yet in the object store
DIRTY_FILES = "cachefs_dirty_files"
WRITEBACK_PENDING_OPERATIONS = "cachefs_writeback_pending_operations"  # uploads, deletes, directories
UPLOADS_IN_FLIGHT = "cachefs_uploads_in_flight"
UPLOADS_TOTAL = "cachefs_uploads_total"
UPLOADED_BYTES_TOTAL = "cachefs_uploaded_bytes_total"
UPLOAD_FAILURES_TOTAL = "cachefs_upload_failures_total"  # failed attempts (each retried)
OLDEST_DIRTY_AGE_SECONDS = "cachefs_oldest_dirty_age_seconds"
# The oldest acknowledged version not yet uploaded: bounded by --upload-max-delay while the store answers.
OLDEST_UNUPLOADED_AGE_SECONDS = "cachefs_oldest_unuploaded_age_seconds"
WRITEBACK_STORE_STATE = "cachefs_writeback_store_state"  # label state; 1 for the current state
WRITEBACK_STORE_STATES = STORE_STATES
STAGING_USED_BYTES = "cachefs_staging_used_bytes"
STAGING_LIMIT_BYTES = "cachefs_staging_limit_bytes"
WRITEBACK_ENOSPC_TOTAL = "cachefs_writeback_enospc_errors_total"

# Per volume (label "volume": MountSettings.source_label, one value per daemon, the same on every
# node mounting the same source, so sum by (volume) adds up a dataset across nodes). What the cache
# saved: reads by the place that answered them (label "tier": ram, disk, cluster, source), what the
# source and the cluster store were sent (label "store": source, cluster; "direction": read, upload).
VOLUME_SERVED_BYTES_TOTAL = "cachefs_volume_served_bytes_total"
VOLUME_SERVED_BLOCKS_TOTAL = "cachefs_volume_served_blocks_total"
VOLUME_STORE_REQUESTS_TOTAL = "cachefs_volume_store_requests_total"  # labels volume, store, direction
VOLUME_STORE_BYTES_TOTAL = "cachefs_volume_store_bytes_total"  # labels volume, store, direction
VOLUME_AVOIDED_SOURCE_BYTES_TOTAL = "cachefs_volume_avoided_source_bytes_total"
VOLUME_AVOIDED_SOURCE_REQUESTS_TOTAL = "cachefs_volume_avoided_source_requests_total"
VOLUME_HIT_RATIO = "cachefs_volume_hit_ratio"  # labels volume, scope: all (the hit ratio), local (RAM + disk), cluster, source

_REQUESTS_SUFFIX = "_requests"


def _histogram_buckets(hist: LatencyHistogram) -> list[tuple[str, float]]:
    return [("+Inf" if math.isinf(bound) else repr(bound), float(n)) for bound, n in hist.cumulative()]


class CacheFSCollector(Collector):
    """Builds every ``cachefs_*`` family from the stats document and the latency histograms."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]],
                 latency: Callable[[], Mapping[str, LatencyHistogram]]) -> None:
        self._snapshot = snapshot
        self._latency = latency

    def collect(self) -> Iterator[Metric]:
        doc = self._snapshot()
        yield from self._tiers(doc.get("tiers", {}), doc.get("cluster"))
        yield from self._store(doc.get("object_store", {}))
        yield from self._store_health(doc.get("store_health"), doc.get("filesystem", {}))
        yield from self._blocks(doc)
        yield from self._warm(doc.get("warm", {}), doc.get("pins", {}))
        yield from self._filesystem(doc.get("filesystem", {}))
        yield from self._fuse(doc.get("fuse", {}))
        yield from self._writeback(doc.get("writeback"))
        yield from self._announce(doc.get("announce"))
        yield from self._traffic(str(doc.get("volume", "")), doc.get("traffic"))

    @staticmethod
    def _traffic(volume: str, traffic: Any) -> Iterator[Metric]:
        if not isinstance(traffic, dict):
            return
        for name, field, doc in (
            (VOLUME_SERVED_BYTES_TOTAL, "served_bytes", "Bytes of reads answered, by the tier that answered them."),
            (VOLUME_SERVED_BLOCKS_TOTAL, "served_blocks", "Block requests of reads answered, by the tier."),
        ):
            family = CounterMetricFamily(name, doc, labels=["volume", "tier"])
            for tier, value in sorted(traffic.get(field, {}).items()):
                family.add_metric([volume, tier], value)
            yield family
        requests = CounterMetricFamily(VOLUME_STORE_REQUESTS_TOTAL,
                                       "Requests sent to the source and to the cluster store: reads (GET) and uploads (PUT).",
                                       labels=["volume", "store", "direction"])
        moved = CounterMetricFamily(VOLUME_STORE_BYTES_TOTAL,
                                    "Bytes read from and uploaded to the source and the cluster store.",
                                    labels=["volume", "store", "direction"])
        for store, section in (("source", traffic.get("source")), ("cluster", traffic.get("cluster_store"))):
            if not isinstance(section, dict):
                continue
            requests.add_metric([volume, store, "read"], section.get("read_requests", 0))
            requests.add_metric([volume, store, "upload"], section.get("upload_requests", 0))
            moved.add_metric([volume, store, "read"], section.get("read_bytes", 0))
            moved.add_metric([volume, store, "upload"], section.get("uploaded_bytes", 0))
        yield requests
        yield moved
        for name, field, doc in (
            (VOLUME_AVOIDED_SOURCE_BYTES_TOTAL, "avoided_source_bytes",
             "Bytes of reads answered by RAM, disk or the cluster tier: not pulled from the source."),
            (VOLUME_AVOIDED_SOURCE_REQUESTS_TOTAL, "avoided_source_requests",
             "Block requests answered by RAM, disk or the cluster tier: GETs the source did not get."),
        ):
            avoided = CounterMetricFamily(name, doc, labels=["volume"])
            avoided.add_metric([volume], traffic.get(field, 0))
            yield avoided
        ratio = GaugeMetricFamily(VOLUME_HIT_RATIO, "Share of read bytes since the mount: scope all is the hit "
                                  "ratio (not from the source), local (RAM + disk) and cluster its parts, source "
                                  "the rest.", labels=["volume", "scope"])
        ratio.add_metric([volume, "all"], traffic.get("hit_ratio", 0.0))
        for scope, value in sorted(traffic.get("hit_ratios", {}).items()):
            ratio.add_metric([volume, scope], value)
        yield ratio

    @staticmethod
    def _tiers(local: dict[str, dict[str, Any]], cluster: dict[str, Any] | None) -> Iterator[Metric]:
        tiers = {**local, **({"cluster": cluster} if isinstance(cluster, dict) else {})}
        counters = [
            (TIER_HITS_TOTAL, "hits", "Block lookups answered by the tier."),
            (TIER_MISSES_TOTAL, "misses", "Block lookups the tier could not answer."),
            (TIER_HIT_BYTES_TOTAL, "hit_bytes", "Bytes of reads the tier answered (the range read, not the whole block)."),
            (TIER_MISS_BYTES_TOTAL, "miss_bytes", "Bytes reads had to load from below the tier because it missed."),
            (TIER_INSERTS_TOTAL, "inserts", "Blocks stored in the tier."),
            (TIER_EVICTIONS_TOTAL, "evictions", "Blocks evicted to make room."),
            (TIER_EVICTED_BYTES_TOTAL, "evicted_bytes", "Bytes evicted to make room."),
            (TIER_ERRORS_TOTAL, "errors", "I/O errors of the tier (each one served as a miss)."),
            (TIER_CORRUPT_BLOCKS_TOTAL, "corrupt_blocks", "Blocks that failed their checks and were dropped."),
        ]
        for name, field, doc in counters:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, values in tiers.items():
                family.add_metric([tier], values.get(field, 0))
            yield family
        gauges = [
            (TIER_USED_BYTES, "used_bytes", "Bytes held by the tier (on disk: whole block files)."),
            (TIER_CAPACITY_BYTES, "capacity_bytes", "Configured capacity of the tier."),
            (TIER_ENTRIES, "entries", "Blocks held by the tier."),
        ]
        for name, field, doc in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, values in local.items():
                gauge.add_metric([tier], values.get(field, 0))
            yield gauge
        wb = cluster.get("write_behind") if isinstance(cluster, dict) else None
        if isinstance(cluster, dict):
            inserted = CounterMetricFamily(TIER_INSERTED_BYTES_TOTAL, "Bytes stored in the tier (cluster tier).",
                                           labels=["tier"])
            inserted.add_metric(["cluster"], cluster.get("inserted_bytes", 0))
            yield inserted
            for name, field, doc in (
                (TIER_FORGED_BLOCKS_TOTAL, "forged_blocks",
                 "Cluster objects whose MAC failed (not written with the cluster key): never served."),
                (TIER_AUTHORIZATION_REQUESTS_TOTAL, "authorization_requests",
                 "Source requests proving this volume may read an object before a cluster hit is served."),
                (TIER_AUTHORIZATION_REFUSED_TOTAL, "authorization_refused",
                 "Cluster hits not served: the volume's source credentials may not read the object."),
            ):
                family = CounterMetricFamily(name, doc, labels=["tier"])
                family.add_metric(["cluster"], cluster.get(field, 0))
                yield family
        if isinstance(wb, dict):
            for name, field, doc, kind in (
                (TIER_WRITE_BEHIND_DEPTH, "depth", "Blocks waiting for upload to the tier (queued or deferred), "
                 "or uploading.", GaugeMetricFamily),
                (TIER_WRITE_BEHIND_BYTES, "queued_bytes", "Bytes held in memory for those blocks.", GaugeMetricFamily),
                (TIER_WRITE_BEHIND_WRITTEN_TOTAL, "written", "Blocks the write-behind uploaded.", CounterMetricFamily),
                (TIER_WRITE_BEHIND_DROPPED_TOTAL, "dropped", "Blocks neither queued nor deferred (the queue full, "
                 "and no disk tier to read them back from, or too many deferred).", CounterMetricFamily),
                (TIER_WRITE_BEHIND_DEFERRED_TOTAL, "deferred", "Blocks offered to a full queue, to be read back "
                 "from the disk tier and uploaded once it has room.", CounterMetricFamily),
                (TIER_WRITE_BEHIND_CAUGHT_UP_TOTAL, "caught_up", "Deferred blocks read back from the disk tier "
                 "and handed to the tier.", CounterMetricFamily),
                (TIER_WRITE_BEHIND_GONE_TOTAL, "gone", "Deferred blocks no longer on the disk tier when their "
                 "turn came.", CounterMetricFamily),
                (TIER_WRITE_BEHIND_PRESENT_TOTAL, "present", "Deferred blocks the tier already held when their "
                 "turn came (stored by another node): not uploaded again.", CounterMetricFamily),
            ):
                wb_family: GaugeMetricFamily | CounterMetricFamily = kind(name, doc, labels=["tier"])
                wb_family.add_metric(["cluster"], wb.get(field, 0))
                yield wb_family
        policy = CounterMetricFamily(TIER_EVICTIONS_BY_POLICY_TOTAL,
                                     "Blocks evicted, by the policy that chose them (lru, announced).",
                                     labels=["tier", "policy"])
        for tier, values in local.items():  # the cluster tier evicts nothing (cachefs cluster gc does)
            ordered = values.get("ordered_evictions", 0)
            policy.add_metric([tier, "lru"], values.get("evictions", 0) - ordered)
            policy.add_metric([tier, "announced"], ordered)
        yield policy
        state = GaugeMetricFamily(TIER_STATE, "Health of the tier: 1 for its current state.", labels=["tier", "state"])
        for tier, values in tiers.items():
            if "state" in values:
                for name in TIER_STATES:
                    state.add_metric([tier, name], 1.0 if str(values["state"]) == name else 0.0)
        yield state

    def _store(self, store: dict[str, Any]) -> Iterator[Metric]:
        requests = CounterMetricFamily(STORE_REQUESTS_TOTAL, "Requests sent to the object store.",
                                       labels=["operation"])
        for field, value in sorted(store.items()):
            if field.endswith(_REQUESTS_SUFFIX) and isinstance(value, (int, float)):
                requests.add_metric([field[: -len(_REQUESTS_SUFFIX)]], value)
        yield requests
        yield CounterMetricFamily(STORE_READ_BYTES_TOTAL, "Bytes read from the object store.",
                                  value=store.get("bytes_read", 0))
        yield CounterMetricFamily(STORE_ERRORS_TOTAL, "Failed object-store requests.", value=store.get("errors", 0))
        latency = HistogramMetricFamily(STORE_REQUEST_DURATION_SECONDS,
                                        "Duration of object-store requests made by the block cache.",
                                        labels=["operation"])
        for op, hist in sorted(self._latency().items()):
            latency.add_metric([op], _histogram_buckets(hist), sum_value=hist.sum_s)
        yield latency

    @staticmethod
    def _store_health(health: Any, fs: dict[str, Any]) -> Iterator[Metric]:
        stale = CounterMetricFamily(STALE_METADATA_SERVED_TOTAL,
                                    "Cached metadata served past its TTL because the object store was unreachable.",
                                    labels=["kind"])
        stale.add_metric(["listing"], fs.get("stale_listings_served", 0))
        stale.add_metric(["attributes"], fs.get("stale_attributes_served", 0))
        yield stale
        if not isinstance(health, dict):
            return
        yield GaugeMetricFamily(STORE_REACHABLE, "1 while the object store answers, 0 while it is taken as unreachable.",
                                value=1.0 if health.get("state") == "reachable" else 0.0)
        yield GaugeMetricFamily(STORE_UNREACHABLE_SECONDS, "How long the object store has been unreachable (0: it is not).",
                                value=health.get("unreachable_for_s", 0.0))
        yield CounterMetricFamily(STORE_OUTAGES_TOTAL, "Times the object store became unreachable.",
                                  value=health.get("outages", 0))
        yield CounterMetricFamily(STORE_TIMEOUTS_TOTAL, "Object-store calls that did not answer within their deadline.",
                                  value=health.get("timeouts", 0))
        yield CounterMetricFamily(STORE_SHORT_CIRCUITED_TOTAL,
                                  "Object-store calls failed at once because the store was unreachable.",
                                  value=health.get("short_circuited", 0))

    @staticmethod
    def _blocks(doc: dict[str, Any]) -> Iterator[Metric]:
        blocks = doc.get("blocks", {})
        yield CounterMetricFamily(BLOCK_REQUESTS_TOTAL, "Blocks requested by reads.", value=blocks.get("requests", 0))
        served = CounterMetricFamily(BLOCKS_SERVED_TOTAL, "Blocks served to reads, by where they came from.",
                                     labels=["tier"])
        served.add_metric(["ram"], blocks.get("ram_served", 0))
        served.add_metric(["disk"], blocks.get("disk_served", 0))
        served.add_metric(["cluster"], blocks.get("cluster_served", 0))
        served.add_metric(["object_store"], blocks.get("fetched", 0))
        yield served
        yield CounterMetricFamily(FETCH_ERRORS_TOTAL, "Block fetches that failed.", value=blocks.get("fetch_errors", 0))
        yield CounterMetricFamily(READAHEAD_BYTES_TOTAL, "Bytes fetched by read-ahead.",
                                  value=blocks.get("readahead_bytes", 0))
        yield CounterMetricFamily(SINGLEFLIGHT_JOINS_TOTAL, "Block requests that joined a fetch in flight.",
                                  value=blocks.get("singleflight_joins", 0))
        yield GaugeMetricFamily(IN_FLIGHT_BYTES, "Bytes of blocks being loaded, counted against the RAM tier.",
                                value=blocks.get("in_flight_bytes", 0))
        yield CounterMetricFamily(MEMORY_WAITS_TOTAL,
                                  "Block loads that waited for RAM-tier room for their block in flight.",
                                  value=blocks.get("memory_waits", 0))
        yield CounterMetricFamily(DROPPED_BYTES_TOTAL, "Bytes dropped from the tiers on request (cachefs evict).",
                                  value=blocks.get("dropped_bytes", 0))
        yield GaugeMetricFamily(HIT_RATIO, "Share of the bytes read since the mount that did not come from the "
                                "source (RAM, disk or the cluster tier; read-ahead the source served is not a hit).",
                                value=doc.get("hit_ratio", 0.0))

    @staticmethod
    def _warm(warm: dict[str, Any], pins: dict[str, Any]) -> Iterator[Metric]:
        yield CounterMetricFamily(WARM_BYTES_TOTAL, "Bytes fetched from the object store by warming the disk tier.",
                                  value=warm.get("bytes", 0))
        yield CounterMetricFamily(WARM_BLOCKS_TOTAL, "Blocks fetched from the object store by warming the disk tier.",
                                  value=warm.get("blocks", 0))
        yield CounterMetricFamily(WARM_SKIPPED_BYTES_TOTAL, "Bytes warming found on the disk tier already.",
                                  value=warm.get("skipped_bytes", 0))
        yield CounterMetricFamily(WARM_NOT_STORED_BLOCKS_TOTAL,
                                  "Blocks warming could not store on the disk tier.",
                                  value=warm.get("not_stored_blocks", 0))
        yield GaugeMetricFamily(PINNED_BYTES, "Bytes of pinned blocks on the disk tier.",
                                value=pins.get("cached_bytes", 0))
        yield GaugeMetricFamily(PINNED_DECLARED_BYTES, "Disk footprint of every pinned object, cached or not.",
                                value=pins.get("bytes", 0))
        yield GaugeMetricFamily(PINNED_OBJECTS, "Pinned objects.", value=pins.get("objects", 0))
        yield GaugeMetricFamily(PIN_LIMIT_BYTES, "Most bytes that may be pinned (--max-pinned).",
                                value=pins.get("limit_bytes", 0))

    @staticmethod
    def _announce(section: Any) -> Iterator[Metric]:
        if not isinstance(section, dict):
            return
        counters = [
            (ANNOUNCED_FILES_TOTAL, "announced_files", "Files announced in read orders."),
            (ANNOUNCED_BYTES_TOTAL, "announced_bytes", "Bytes of the files announced in read orders."),
            (ANNOUNCE_ORDER_HITS_TOTAL, "order_hits", "Opens of announced files already cached (fetched ahead)."),
            (ANNOUNCE_STALLS_TOTAL, "stalls", "Opens of announced files that had to wait for a block."),
            (ANNOUNCE_PREFETCHED_BLOCKS_TOTAL, "prefetched_blocks", "Blocks loaded ahead of announced readers."),
        ]
        for name, field, doc in counters:
            yield CounterMetricFamily(name, doc, value=section.get(field, 0))
        yield GaugeMetricFamily(ANNOUNCE_WINDOW_BYTES, "Bytes fetched ahead of announced readers now.",
                                value=section.get("window_bytes", 0))
        yield GaugeMetricFamily(ANNOUNCE_STREAMS, "Announced read orders held.", value=section.get("streams", 0))

    @staticmethod
    def _filesystem(fs: dict[str, Any]) -> Iterator[Metric]:
        ops = CounterMetricFamily(FS_OPERATIONS_TOTAL, "Filesystem operations served.", labels=["operation"])
        for op, field in (("lookup", "lookups"), ("listing", "listings"), ("open", "opens"), ("read", "reads")):
            ops.add_metric([op], fs.get(field, 0))
        yield ops
        yield CounterMetricFamily(FS_READ_BYTES_TOTAL, "Bytes returned by reads.", value=fs.get("read_bytes", 0))
        yield CounterMetricFamily(FS_LISTING_ERRORS_TOTAL, "Directory listings that failed.",
                                  value=fs.get("listing_errors", 0))
        yield CounterMetricFamily(FS_SKIPPED_KEYS_TOTAL, "Object keys skipped because they cannot be file names.",
                                  value=fs.get("skipped_keys", 0))
        yield GaugeMetricFamily(FS_INODES, "Inodes known to the kernel.", value=fs.get("inodes", 0))
        yield GaugeMetricFamily(FS_OPEN_HANDLES, "Open file and directory handles.", value=fs.get("open_handles", 0))

    @staticmethod
    def _fuse(section: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily(FUSE_PASSTHROUGH, "1 when the kernel reads whole files of the disk tier itself.",
                                value=1 if section.get("passthrough") else 0)
        yield CounterMetricFamily(FUSE_PASSTHROUGH_OPENS_TOTAL, "Opens the kernel reads through a backing file.",
                                  value=section.get("passthrough_opens", 0))
        yield CounterMetricFamily(FUSE_PASSTHROUGH_REFUSED_TOTAL,
                                  "Opens refused (ETXTBSY): another version was held open through passthrough.",
                                  value=section.get("passthrough_refused", 0))
        yield CounterMetricFamily(FUSE_PASSTHROUGH_FALLBACKS_TOTAL,
                                  "Whole files the kernel would not register; the daemon served those reads.",
                                  value=section.get("passthrough_fallbacks", 0))
        yield CounterMetricFamily(FUSE_BACKING_REGISTRATIONS_TOTAL,
                                  "Backing files registered with the kernel (kept between opens of one inode).",
                                  value=section.get("backing_registrations", 0))
        yield GaugeMetricFamily(FUSE_BACKING_IDS, "Backing ids registered now (in use, or kept for the next open).",
                                value=section.get("backing_ids", 0))
        requests = CounterMetricFamily(FUSE_REQUESTS_TOTAL, "FUSE requests the kernel sent the daemon, by opcode.",
                                       labels=["opcode"])
        for opcode, count in sorted((section.get("requests") or {}).items()):
            requests.add_metric([opcode], count)
        yield requests
        for name, key, text in (
                (FUSE_INVAL_ENTRIES_TOTAL, "inval_entries", "Entries the kernel was told to drop (changed in the bucket)."),
                (FUSE_INVAL_INODES_TOTAL, "inval_inodes", "Inodes whose attributes and pages the kernel was told to drop."),
                (FUSE_INVAL_NOT_CACHED_TOTAL, "inval_not_cached", "Of those, ones the kernel did not hold (ENOENT)."),
                (FUSE_INVAL_ERRORS_TOTAL, "inval_errors", "Notifications the kernel refused otherwise."),
                (FUSE_INVAL_DROPPED_TOTAL, "inval_dropped", "Notifications not sent: too many were queued.")):
            yield CounterMetricFamily(name, text, value=section.get(key, 0))
        whole = section.get("whole_files") or {}
        yield GaugeMetricFamily(WHOLE_FILES, "Whole files on the disk tier (passthrough).", value=whole.get("files", 0))
        yield GaugeMetricFamily(WHOLE_FILE_BYTES, "Bytes of whole files on the disk tier (part of its used bytes).",
                                value=whole.get("bytes", 0))
        yield CounterMetricFamily(WHOLE_FILES_ASSEMBLED_TOTAL, "Whole files written from checked blocks.",
                                  value=whole.get("assembled", 0))

    @staticmethod
    def _writeback(section: Any) -> Iterator[Metric]:
        if not isinstance(section, dict):
            return

        def number(field: str) -> float:
            value = section.get(field, 0)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

        for name, field, doc in (
            (DIRTY_BYTES, "dirty_bytes", "Written bytes not yet uploaded to the object store."),
            (DIRTY_FILES, "dirty_files", "Written files not yet uploaded to the object store."),
            (WRITEBACK_PENDING_OPERATIONS, "pending_operations",
             "Changes not yet in the object store: uploads, deletes and directory markers."),
            (UPLOADS_IN_FLIGHT, "uploads_in_flight", "Uploads (and deletes) running now."),
            (OLDEST_DIRTY_AGE_SECONDS, "oldest_dirty_age_s", "Age of the oldest change not yet in the object store."),
            (OLDEST_UNUPLOADED_AGE_SECONDS, "oldest_unuploaded_age_s",
             "Age of the oldest acknowledged (closed or fsync'd) version not yet in the object store."),
            (STAGING_USED_BYTES, "staged_bytes", "Disk space held by staged (dirty) data."),
            (STAGING_LIMIT_BYTES, "staging_limit_bytes",
             "Disk space staged data may use (the disk cache's capacity, shared with clean blocks)."),
        ):
            yield GaugeMetricFamily(name, doc, value=number(field))
        for name, field, doc in (
            (UPLOADS_TOTAL, "files_uploaded", "Files uploaded to the object store."),
            (UPLOADED_BYTES_TOTAL, "bytes_uploaded", "Bytes uploaded to the object store."),
            (UPLOAD_FAILURES_TOTAL, "failed_attempts", "Upload, delete and marker attempts that failed (and are retried)."),
            (WRITEBACK_ENOSPC_TOTAL, "enospc_errors", "Writes refused with ENOSPC: staging space stayed full."),
        ):
            yield CounterMetricFamily(name, doc, value=number(field))
        state = GaugeMetricFamily(WRITEBACK_STORE_STATE, "Whether uploads reach the object store: 1 for the current state.",
                                  labels=["state"])
        for name in WRITEBACK_STORE_STATES:
            state.add_metric([name], 1.0 if section.get("store_state") == name else 0.0)
        yield state


def make_registry(snapshot: Callable[[], dict[str, Any]],
                  latency: Callable[[], Mapping[str, LatencyHistogram]], *, process: bool = True) -> CollectorRegistry:
    """A private registry with the cachefs collector (and the daemon's ``process_*`` metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheFSCollector(snapshot, latency))
    if process:
        ProcessCollector(registry=registry)
    return registry


def metrics_handler(registry: CollectorRegistry) -> Callable[[web.Request], Any]:
    async def handle(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return handle


class MetricsFeature:
    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def install(ctx: DaemonContext) -> MetricsFeature:
    volume = ctx.settings.source_label()
    registry = make_registry(lambda: stats_document(ctx.fs, volume), lambda: ctx.cache.latency)
    ctx.control.add_route("GET", "/metrics", metrics_handler(registry), public=True)
    return MetricsFeature()
