"""One block from the object store: a ranged GET under the fetch timeout and the store's circuit.

``SourceFetch`` owns the latency histogram of the engine's GETs (``latency``, exported by the
metrics endpoint as ``BlockCache.latency["get"]``): every GET is timed with the injected clock,
failed ones too (a slow 503 is as interesting as a slow 200), a cancelled one not (it did not
finish). It counts fetched blocks, bytes and errors in the shared ``EngineStats``.

The deadline is counted from ``started_at`` (loop time when the load was started), so a wait for a
fetch slot counts against it too. With a store-health circuit (``tiering.storehealth``) the GET runs
through it: while the store is unreachable a block that needs a GET fails at once. A GET returning
fewer bytes than the block holds is an ``ObjectStoreError``, never a short block in a tier.

Called on the event loop only; the bytes are received by the store's own worker threads
(``tiering.objectstore.rangedget``).
"""

from __future__ import annotations

from typing import Any

from tiering.blocks import BlockData, BlockKey, ObjectRef, block_range
from tiering.clock import Clock
from tiering.engine.stats import EngineStats
from tiering.errors import ObjectStoreError
from tiering.handoff import AfterReceive
from tiering.latency import LatencyHistogram
from tiering.protocols import ObjectStore
from tiering.storehealth import StoreHealth, bounded


class SourceFetch:
    def __init__(self, store: ObjectStore, *, block_size: int, timeout_s: float, clock: Clock,
                 health: StoreHealth | None, stats: EngineStats) -> None:
        self.store = store
        self.latency = LatencyHistogram()
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._clock = clock
        self._health = health
        self._stats = stats

    async def get(self, ref: ObjectRef, key: BlockKey, started_at: float,
                  after: AfterReceive[Any] | None = None) -> BlockData:
        """One GET, under the fetch timeout counted from ``started_at`` (loop time: when the load
        was started, so a wait for a fetch slot counts too). ``after``: work the store's receiving
        thread may claim and run on the bytes (``ObjectStore.get_range``)."""
        start, end = block_range(key.index, ref.size, self._block_size)
        timeout = self._timeout_s
        began = self._clock.monotonic()
        try:
            data = await bounded(self._health, lambda: self.store.get_range(ref.key, ref.etag, start, end, after=after),
                                 timeout, f"reading {ref.key!r}", started_at=started_at)
        except ObjectStoreError:
            self.latency.observe(self._clock.monotonic() - began)
            self._stats.fetch_errors += 1
            raise
        # Failed requests are timed too (a slow 503 is as interesting as a slow 200); a cancelled
        # one is not: it did not finish.
        self.latency.observe(self._clock.monotonic() - began)
        if len(data) != end - start:
            self._stats.fetch_errors += 1
            raise ObjectStoreError(f"short read of {ref.key!r}: got {len(data)} of {end - start} bytes")
        self._stats.store_fetches += 1
        self._stats.store_fetch_bytes += len(data)
        return data
