"""The cachefs data engine, in floors, each importing only those below it.

    writeback/    write-back of files written through the mount: staging, journal, upload
    engine/       the block cache over the tiers, and the prefetcher of announced read orders
    tiers/        where blocks live: RAM, local disk (and the file I/O of one block), the shared
                  cluster tier; the block format
    policy/       read-ahead, read orders, eviction victims, pins: bookkeeping, no block and no store
    objectstore/  the source of truth: S3, local directory, fsspec sources, the in-memory doubles
                  (``policy`` and ``objectstore`` share a floor and never import each other)
    protocols, settings, storehealth
                  the seams (one Protocol each), the engine's settings, the store's health circuit
    buffers, health, checksum, fileio, latency, private, traffic, units
    blocks, clock, errors
                  small leaf modules the floors above share (``buffers``: the one pool of
                  page-aligned block buffers the object stores receive into and the disk tier
                  reads into)

The order is checked by an import-linter ``layers`` contract (pyproject.toml).

This package knows nothing about FUSE, gRPC or Kubernetes. The filesystem in ``cachefs`` asks it for
byte ranges of objects identified by key *and* ETag; everything below that (which tier holds a block,
when to fetch, what to evict) is decided here.
"""
