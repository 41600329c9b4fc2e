"""The cachefs data engine: blocks, tiers (RAM, local disk, object store), eviction, read-ahead.

This package knows nothing about FUSE, gRPC or Kubernetes. The filesystem in ``cachefs`` asks it for
byte ranges of objects identified by key *and* ETag; everything below that (which tier holds a block,
when to fetch, what to evict) is decided here.
"""
