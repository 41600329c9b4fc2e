"""The tiers floor: where cached blocks live, each a bounded store with its own health.

``ram``          ``RamTier``: a byte-bounded LRU of whole blocks in process memory.
``disk``         ``DiskTier``: checksummed block files on local disk under watermarks; also the
                 space budget of staged write-back data.
``cluster``      ``ClusterTier``: blocks as objects in a shared in-cluster store, its write-behind
                 queue and garbage collection.
``blockformat``  the header + data framing both the disk and the cluster tier read and write.

Tiers implement the Protocols of ``tiering.protocols`` and choose their eviction victims with
``tiering.policy.victims``; they know nothing of the engine above them, nor of the object stores
beside the policies below them (the cluster tier talks to its store through the ``ObjectStore``
Protocol).
"""
