"""The engine floor: the block cache over the tiers, and what drives it from announced read orders.

``blockcache``     ``BlockCache``: the facade. A read split into blocks, each from RAM, disk, the
                   cluster tier or the object store, promoted upward on the way back; read-ahead,
                   warming, promotion, pins, invalidation and eviction across the tiers. It composes
                   the pieces below, each owning its state behind a small interface:
``loads``          ``Loads``: the single-flight table, the load tasks and the fetch slots; the loads.
``pinning``        ``PinnedBlocks``: the pin table and its limit, kept in step with the disk tier.
``source``         ``SourceFetch``: one GET under the timeout and the circuit; its latency histogram.
``diskguard``      ``GuardedDisk``: disk-tier calls in a worker thread, a failure taken as a miss.
``stats``          ``EngineStats``: the counters the pieces share.
``orderprefetch``  ``OrderPrefetcher``: the one task that fetches ahead of announced read orders
                   with the engine's fetch slots.

It composes the tiers (``tiering.tiers``) and the policies (``tiering.policy``) below it; write-back
(``tiering.writeback``) is the only floor of tiering above it.
"""
