"""The FUSE edge: cachefs speaks the kernel's FUSE protocol itself, in four rooms (no libfuse binding).

    adapter   ``FuseOperations``: one 1-3 line handler per opcode over ``CacheFS``; errno decided once
    session   the mount (mount(2), fusermount3, or a handed-over descriptor), INIT, reading /dev/fuse
              into reused buffers on the daemon's event loop and answering with ``os.writev``
    replies   the writer threads that send large replies (a READ's data) off the loop
    wire      the kernel's structs and opcodes, decoded and encoded without I/O

Each imports only those below it (an import-linter ``layers`` contract, pyproject.toml). The floor
translates; the filesystem below decides. Design and the oldest supported kernel:
docs/architecture.md, "The FUSE layer".
"""
