"""The engine floor: the block cache over the tiers, and what drives it from announced read orders.

``blockcache``     ``BlockCache``: a read split into blocks, each from RAM, disk, the cluster tier or
                   the object store, promoted upward on the way back; read-ahead, warming, pins,
                   invalidation and eviction across the tiers.
``orderprefetch``  ``OrderPrefetcher``: the one task that fetches ahead of announced read orders
                   with the engine's fetch slots.

It composes the tiers (``tiering.tiers``) and the policies (``tiering.policy``) below it; write-back
(``tiering.writeback``) is the only floor of tiering above it.
"""
