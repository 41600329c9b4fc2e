"""The filesystem's counters: one ``FsStats`` per mount, incremented where the event happens.

The inode table, the listing cache and the filesystem operations share one instance; the daemon's
``/stats`` document (``cachefs.daemon.stats``) and the Prometheus metrics read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FsStats:
    lookups: int = 0
    listings: int = 0
    listing_errors: int = 0
    stale_listings_served: int = 0
    index_listings: int = 0  # listings answered from the on-disk metadata index (no LIST)
    index_errors: int = 0  # metadata index operations that failed (answered by listing instead)
    mtime_heads: int = 0  # HEADs that read a listed file's mtime metadata (--mtime-from-metadata)
    stale_attributes_served: int = 0  # getattr/open kept a node's attributes: store unreachable, listing gone
    opens: int = 0
    passthrough_opens: int = 0  # opens the kernel reads by itself from a whole file (no READ reaches us)
    passthrough_refused: int = 0  # opens answered ETXTBSY: another version held open through passthrough
    passthrough_fallbacks: int = 0  # whole files the kernel would not register (the daemon served them)
    passthrough_active: bool = False  # the FUSE connection agreed to passthrough and may register files
    backing_registrations: int = 0  # backing files registered with the kernel (one per inode and version, kept between opens)
    backing_ids: int = 0  # backing ids registered now (in use by open files, or kept for the next open)
    # FUSE requests read, by opcode: the session's own list (``FuseSession.requests``), once it exists.
    fuse_requests: list[int] = field(default_factory=list)
    # Notifications that the kernel drop what it caches of a name or an inode changed in the bucket
    # (cachefs.fs.kernelcache): written, of those the ones the kernel did not hold (ENOENT, normal),
    # refused otherwise, and dropped unsent (too many queued).
    inval_entries: int = 0
    inval_inodes: int = 0
    inval_not_cached: int = 0
    inval_errors: int = 0
    inval_dropped: int = 0
    opens_waited: int = 0  # opens that waited for an unlink or a rename over their file to finish
    stale_opens: int = 0  # opens of a file whose name went first: ESTALE, the kernel looks it up again
    retried_opens_kept: int = 0  # their retries whose file went after their lookup: opened its kept content
    retried_opens_stale: int = 0  # retries answered ESTALE too (a file over 64 MiB went): the application saw it
    reads: int = 0
    read_bytes: int = 0
    skipped_keys: int = 0
    writes: int = 0
    write_bytes: int = 0
    creates: int = 0
    unlinks: int = 0
    mkdirs: int = 0
    rmdirs: int = 0
    renames: int = 0
    truncates: int = 0
    fallocates: int = 0
    fsyncs: int = 0
    flushes: int = 0  # FLUSH requests (close); a read-only mount gets one, then the kernel stops
