"""The engine's counters: block requests, where each was served from, loads, warming, drops.

``EngineStats`` is plain state with no behaviour but its hit ratio. One instance per ``BlockCache``,
shared by the pieces it composes (the loads, the source fetch, the guarded disk tier), each of which
counts what happens in it; the ``/stats`` document and the metrics endpoint read it. Every counter
is touched on the event loop thread only (worker threads run tier calls and return; the loop counts
their outcome), so no lock is needed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Block requests and where they were served from (one count per block a read touched)."""

    block_requests: int = 0
    ram_served: int = 0
    disk_served: int = 0
    cluster_served: int = 0  # loads of reads (and read-ahead) answered by the cluster tier
    cluster_served_bytes: int = 0
    # Source requests made to prove this volume may read an object before a cluster hit is served
    # (``tiering.engine.authorize``), and the hits refused because the source said no.
    cluster_authorizations: int = 0
    cluster_refused: int = 0
    store_fetches: int = 0
    store_fetch_bytes: int = 0
    fetch_errors: int = 0
    readahead_blocks: int = 0
    readahead_bytes: int = 0
    singleflight_joins: int = 0
    disk_errors: int = 0  # disk-tier calls that raised instead of answering (each one a miss)
    # Bytes a read had to load from below a tier because that tier missed (once per load, however
    # many readers joined it): RAM misses are served by disk or a fetch, disk misses by a fetch.
    ram_miss_bytes: int = 0
    disk_miss_bytes: int = 0
    # warm_block (fetching into the disk tier, for cachefs prefetch jobs)
    warm_blocks: int = 0  # fetched from the store by a warm
    warm_bytes: int = 0
    warm_from_ram_blocks: int = 0  # written to disk from RAM, no GET
    warm_from_cluster_blocks: int = 0  # written to disk from the cluster tier, no source GET
    warm_skipped_blocks: int = 0  # already on disk
    warm_skipped_bytes: int = 0
    warm_not_stored: int = 0  # the disk tier refused the block (full of pinned data, or failing)
    # evict / evict_all: blocks dropped on request (not capacity evictions)
    dropped_blocks: int = 0
    dropped_bytes: int = 0

    def hit_ratio(self) -> float:
        """Share of the blocks reads asked for that a tier served; warming fetches are not reads."""
        served = self.ram_served + self.disk_served + self.cluster_served
        total = served + self.store_fetches - self.warm_blocks
        return served / total if total else 0.0
