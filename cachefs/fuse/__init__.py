"""The FUSE edge: the pyfuse3 adapter (``cachefs.fuse.adapter``) and the kernel connection's tuning.

The only floor that imports pyfuse3; it translates, the filesystem below decides.
"""
