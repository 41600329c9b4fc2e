"""The FUSE edge: cachefs speaks the kernel's FUSE protocol itself, in its own rooms (no libfuse binding).

    adapter   ``FuseOperations``: one 1-3 line handler per opcode over ``CacheFS``; errno decided once
    session   the connection (mounted here, or a handed-over descriptor), INIT, reading /dev/fuse
              into reused buffers on the daemon's event loop and answering with ``os.writev``
    mounting  /dev/fuse, mount(2) as root, the setuid fusermount3 otherwise, unmounting
    replies   the writer threads that send large replies (a READ's data) off the loop
    notifier  the thread that tells the kernel what to forget (FUSE_NOTIFY_INVAL_*)
    backingfiles  who registers passthrough backing files: this process, or the node plugin's broker
    sharedloop    the event loop that reader threads of cloned descriptors share (``--fuse-threads``)
    wire      the kernel's structs and opcodes, decoded and encoded without I/O

Each imports only those below it (an import-linter ``layers`` contract, pyproject.toml). The floor
translates; the filesystem below decides. Design and the oldest supported kernel:
docs/architecture.md, "The FUSE layer".
"""
