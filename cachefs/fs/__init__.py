"""The filesystem floor: POSIX semantics over tiering, knowing no FUSE (``cachefs.fs.filesystem``).

``CacheFS`` is a facade over state objects, each in its own module: the inode table, the listing
cache (with the write-back overlay), the handle table, and rename.
"""
