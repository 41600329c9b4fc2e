"""The FUSE session: the mount, the kernel connection's INIT, and serving requests from /dev/fuse.

**Mounting** follows the kernel's rules the way libfuse did, so nothing a user sees changes: open
``/dev/fuse`` (refused: ``failed to open /dev/fuse: <reason>``), then ``mount(2)`` it with
``fd=N,rootmode=..,user_id=..,group_id=..,default_permissions[,allow_other]``, type ``fuse.cachefs``,
``nosuid,nodev`` (``ro`` for a read-only mount); a user without the privilege (EPERM) has the
setuid ``fusermount3`` mount it instead, which sends the descriptor back over a socket named in
``_FUSE_COMMFD`` (its refusals are its stderr lines, which become the one-line reason). A handed-over
descriptor (``cachefs.handover``: the CSI node plugin mounted it) is used as it is, and left mounted
at the end. The mount's source (``df``, ``findmnt``) is the bucket URL, without credentials or query.

**Serving** runs on the daemon's asyncio loop: ``loop.add_reader`` on the non-blocking descriptor
reads each request into one reused buffer (``os.readv``; max_write plus a page, the kernel's
minimum), decodes it (``cachefs.fuse.wire``), and answers with one ``os.writev`` of the reply header
and the handler's buffers (an inline handler's ``bytes`` or ``None`` straight from ``_dispatch``,
the rest through ``send``) (a read's data is the engine's memoryview: no join, no copy); a reply of
``OFFLOAD_MIN_BYTES`` or more is written by a writer thread instead (``cachefs.fuse.replies``), so the
kernel's copy of its bytes is not the loop's. Handlers the filesystem answers without waiting
(release, forget, statfs, readdir, xattrs, and a lookup, getattr or open whose listing is fresh:
those return ``LATER`` otherwise) run inline; the others run as tasks, at most ``max_tasks`` at once
(reading pauses at the bound). A task's request outlives
the buffer, so its arguments are copied out first (a few bytes), except a WRITE's payload: its buffer
is set aside until the write ends and the next read uses another (a small pool).

**The protocol's rules**: INIT is negotiated with the running kernel (``wanted_flags``: only what it
offers is used; minor ``wire.MIN_KERNEL_MINOR`` at least). FORGET and BATCH_FORGET get no reply.
INTERRUPT cancels the handler's task when the request only reads (``INTERRUPTIBLE``), which then
answers EINTR; a modifying request runs to its end (a half-done write-back step is worse than a late
answer). An opcode no handler takes is answered ENOSYS, which the kernel remembers for most. A read
that fails with ENODEV means the mount is gone: ``serve`` returns. ENOENT on a reply means the
kernel gave up on that request (interrupted or aborted): nothing to do.

**Notifications** (``Notifier``): FUSE_NOTIFY_INVAL_ENTRY and _INODE, which the filesystem sends
when a re-list finds a change made behind the mount's back (``cachefs.fs.kernelcache``), are written
by a thread of their own, never from the loop: the kernel may wait inside that write for a lock a
request we have not answered yet holds.

**Passthrough** (Linux 6.9+, ``CONFIG_FUSE_PASSTHROUGH``): when the adapter asks for it
(``Operations.wanted_flags``), the kernel offers it and this process may register backing files
(``may_register_backing``: CAP_SYS_ADMIN in the initial user namespace, what the kernel checks), INIT
answers with PASSTHROUGH in ``flags2`` and ``max_stack_depth`` 1 (backing files on a filesystem that
is not itself stacked, as the cache directory is; the FUSE mount may then still be an overlayfs
layer). ``BackingFiles`` registers an open file with ``FUSE_DEV_IOC_BACKING_OPEN`` and drops the
registration with ``FUSE_DEV_IOC_BACKING_CLOSE``; the adapter decides which opens use it. A daemon
without that capability (the CSI node plugin's mounts) is given a broker instead (``broker``: the
plugin's socket, ``cachefs.backing``): INIT agrees to PASSTHROUGH when the broker answers a probe, and
``BrokerBackingFiles`` has the plugin do each ioctl. Where any condition fails the session says so in
one log line and every read is served as before.

**Several readers** (``threads`` > 1, on a ``SharedLoop``): after INIT the session clones its
descriptor (``FUSE_DEV_IOC_CLONE``; a handed-over descriptor may come with clones the privileged
process opened, ``clones``, used first) and one thread per descriptor reads requests, blocked in ``readv``
with the GIL released, and answers them holding the loop's state lock: inline handlers, and the first
step of a handler's task (``SharedLoop.start_task``), so a request answered without waiting never
turns the loop; an inline answer is written once the reader has let go of the lock. A handler of
``Operations.reader_inline`` (a READ the disk tier holds) may return an ``OffLock``: the reader runs
its blocking part without the lock, then finishes it with the lock and writes its reply itself. Each reply goes
on the descriptor its request was read from (each clone has its own list of requests being processed). An INTERRUPT read before its request is kept for the reader that
starts it. When every reader has seen the end of the connection, ``serve`` returns; see
docs/architecture.md, "Several readers".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import struct
import select
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Protocol, Union

from cachefs.backing import BrokerBackingFiles, BrokerError
from cachefs.fuse import wire
from cachefs.fuse.backingfiles import Backing, BackingFiles, may_register_backing
from cachefs.fuse.mounting import (
    FUSE_DEVICE,
    SUBTYPE,
    MountError,
    clone_device,
    fuse_failure_reason,
    fusermount,
    mount_syscall,
    open_device,
    unmount,
)
from cachefs.fuse.notifier import Notifier
from cachefs.fuse.replies import OFFLOAD_MIN_BYTES, ReplyWriters, reply_failed
from cachefs.fuse.sharedloop import SharedLoop
from cachefs.fuse.wire import FuseError, Request
from cachefs.mounts import mount_source
from cachefs.settings import MAX_FUSE_THREADS
from cachefs.tuning import FUSE_CONGESTION_THRESHOLD, FUSE_MAX_BACKGROUND

log = logging.getLogger(__name__)

# The largest write the kernel sends and the largest read it asks for: 1 MiB (256 pages, the kernel's
# default max_pages_limit), what libfuse 3 negotiated; a 1 MiB request costs one round trip where
# 128 KiB ones cost eight (cachefs.tuning has the measured effect with the read-ahead).
MAX_WRITE = 1024 * 1024
MAX_PAGES = MAX_WRITE // 4096
# One request buffer: the kernel refuses reads of /dev/fuse into less than max_write plus the headers.
BUFFER_SIZE = MAX_WRITE + 4096
# WRITE payloads keep their buffer until the write ends; idle buffers kept for reuse (each 1 MiB).
SPARE_BUFFERS = 4
# How long the end of serve() waits for the handlers it cancelled (they end at their next await).
CANCEL_WAIT_S = 10
# Requests read per wake-up of the loop before it looks at its other work.
READS_PER_WAKEUP = 16
# Interrupts of requests no reader has started yet, kept for when one does (a request and its
# interrupt may be read by two threads); the oldest are dropped past this many (an interrupt that
# came after its request was answered is never claimed).
EARLY_INTERRUPTS = 1024
# Opcodes counted by ``FuseSession.requests`` (every one the protocol defines is below this).
REQUEST_COUNTS = 64
# How long close() waits for the reader threads to see the end of the connection after unmounting.
READER_JOIN_S = 5.0
# A reader's blocking work (a disk-tier read) running this long is a hung device: another reader takes
# over its descriptor and the work is told (the disk tier goes down), so the device costs the reads
# already waiting on it, not the mount. Looked at every STALL_CHECK_S by the loop.
STALL_S = 10.0
STALL_CHECK_S = 1.0

# What the kernel may do, and cachefs wants (each used only when the kernel's INIT offers it):
# reads in parallel and in the background, 1 MiB requests, lookups of one directory in parallel,
# O_TRUNC in OPEN (CacheFS.open truncates), readdir with attributes (the adapter counts the
# lookups it hands over), cached pages dropped when a file's mtime or size changes, and the same
# killpriv and async direct I/O defaults libfuse 3 asked for. No write-back cache (the write path
# relies on seeing each write), no export support (lookups of "." and ".." by nodeid), no locks
# (the kernel keeps them local).
WANTED_FLAGS = (wire.ASYNC_READ | wire.BIG_WRITES | wire.MAX_PAGES | wire.PARALLEL_DIROPS | wire.ATOMIC_O_TRUNC
                | wire.DO_READDIRPLUS | wire.AUTO_INVAL_DATA | wire.ASYNC_DIO | wire.HANDLE_KILLPRIV
                | wire.NO_OPEN_SUPPORT)
# Passthrough's max_stack_depth: backing files live in the cache directory, on a plain filesystem
# (depth 0 < 1). A cache directory on overlayfs (depth 1) is refused per file with ELOOP, and those
# reads are served by the daemon; 2 would allow it but keep the mount from being an overlayfs layer.
PASSTHROUGH_STACK_DEPTH = 1
# Requests that only read: an interrupt may cancel them (nothing is left half done).
INTERRUPTIBLE = frozenset({wire.LOOKUP, wire.GETATTR, wire.READ, wire.OPENDIR, wire.READDIR, wire.READDIRPLUS,
                           wire.STATFS, wire.GETXATTR, wire.LISTXATTR})
NO_REPLY = frozenset({wire.FORGET, wire.BATCH_FORGET})

# wire.out_header without its call: every reply packs one (the header's fields, as the kernel wants).
_OUT_HEADER_PACK = wire.OUT_HEADER.pack
_OUT_HEADER_SIZE = wire.OUT_HEADER.size
_parse_request, _writev = wire.parse_request, os.writev  # (bound once: used for every request)

Buffer = Union[bytes, bytearray, memoryview]
Reply = Union[None, Buffer, Sequence[Buffer]]


class Later:
    """What an inline handler returns when it cannot answer without waiting (see ``Operations``)."""

    __slots__ = ()


LATER = Later()


class OffLock:
    """What a reader thread's inline handler (``Operations.reader_inline``) returns for an answer
    that needs blocking work first (a disk-tier read): the reader lets go of the state lock, calls
    ``run`` (I/O, no shared state), takes the lock again and calls ``finish``, whose reply it writes
    itself before it reads its next request (the reply may be a view of that thread's buffer), or
    whose ``LATER`` runs the request's handler as a task."""

    __slots__ = ()

    def run(self) -> None:
        raise NotImplementedError

    def stalled(self, seconds: float) -> None:
        """``run`` has not returned for ``seconds``; called from the loop, while it still runs."""

    def finish(self) -> Reply | Later:
        raise NotImplementedError


class Operations(Protocol):
    """What the session needs of the adapter: the handlers by opcode, and the errno of a failure.

    An opcode may have both: its inline handler answers what it can at once and returns ``LATER``
    for the rest, which then runs as a task through ``handlers`` (a warm OPEN costs no task)."""

    @property
    def inline(self) -> dict[int, Callable[[Request], Reply | Later]]: ...

    @property
    def handlers(self) -> dict[int, Callable[[Request], Awaitable[Reply]]]: ...

    @property
    def reader_inline(self) -> dict[int, Callable[[Request], Reply | Later | OffLock]]:
        """Inline handlers for reader threads only, over ``inline``'s: they may return an ``OffLock``
        (blocking work the reader does without the state lock, which the loop must never do)."""
        ...

    def failure(self, opcode: int, exc: BaseException) -> int: ...

    @property
    def wanted_flags(self) -> int:
        """INIT flags the adapter would use beyond ``WANTED_FLAGS`` (PASSTHROUGH, or 0)."""
        ...

    def negotiated(self, flags: int, backing: Backing | None, notifier: Notifier | None) -> None:
        """What the kernel agreed to; ``backing`` registers backing files where PASSTHROUGH was agreed,
        ``notifier`` tells the kernel to drop what it cached (None: the kernel takes no notifications)."""
        ...


# ---------------------------------------------------------------------------------------- session
class FuseSession:
    """One mount's connection to the kernel: mount, serve until unmounted or terminated, close."""

    def __init__(self, ops: Operations, mountpoint: str, *, source: str = SUBTYPE, read_only: bool = False,
                 allow_other: bool = False, fd: int | None = None, broker: Path | None = None,
                 threads: int = 1, clones: Sequence[int] = ()) -> None:
        self.ops = ops
        self.mountpoint = mountpoint
        self.fsname = mount_source(source)
        self.read_only = read_only
        self.allow_other = allow_other
        self.fd = -1 if fd is None else fd
        self.handed_over = fd is not None
        self.broker = broker  # the node plugin's backing-file broker (cachefs.backing), for passthrough
        self._broker_client: BrokerBackingFiles | None = None
        self.privileged = False
        self.proto_minor = 0
        self.flags = 0
        self._buffer = bytearray(BUFFER_SIZE)
        self._spare: list[bytearray] = []
        self._tasks: dict[int, tuple[asyncio.Task[None], int]] = {}
        self._interrupted: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: asyncio.Future[None] | None = None
        self._reading = False
        self._max_tasks = 1
        self._closed = False
        self._writers: ReplyWriters | None = None  # large replies' writev, off the loop (cachefs.fuse.replies)
        self.notifier: Notifier | None = None
        self._poller = select.poll()  # registered with the descriptor by serve()
        # Several readers (``threads`` > 1, on a SharedLoop): started after INIT, one thread per
        # descriptor (the session's and its clones); the loop then reads nothing.
        self.threads = max(1, min(threads, MAX_FUSE_THREADS))
        self._threaded = False
        self._readers: list[threading.Thread] = []
        # Clones of a handed-over descriptor's connection, opened by the process that handed it over
        # (a mount pod cannot open /dev/fuse): the readers use them before cloning any; closed by close().
        self._clones: list[int] = list(clones)
        self._readers_left = 0
        # Readers running blocking work: thread id -> (since, the work, its descriptor); the ids of
        # those replaced meanwhile, which end once their work returns (``_watch_stalls``).
        self._stalls: dict[int, tuple[float, OffLock, int]] = {}
        self._replaced: set[int] = set()
        self._room: threading.Condition | None = None
        self._early: dict[int, None] = {}
        self._inline = ops.inline  # (the dict itself, bound once: looked up for every request)
        # Requests read, by opcode (``wire.OPCODE_NAMES``): what /stats shows as the requests that
        # reached the daemon (a warm file's OPEN and RELEASE, a READ the kernel could not serve).
        self.requests = [0] * REQUEST_COUNTS
        self._reader_inline: dict[int, Callable[[Request], Reply | Later | OffLock]] = {
            **ops.inline, **ops.reader_inline}

    # ---------------------------------------------------------------------------- mount and close
    def mount(self) -> None:
        """Mount (unless handed over); ``OSError`` with a one-line reason if refused."""
        if self.handed_over:
            return
        try:
            fd = open_device()
            try:
                mount_syscall(fd, self.mountpoint, self.fsname, read_only=self.read_only, allow_other=self.allow_other)
                self.privileged = True
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EPERM:
                    raise MountError(exc.errno, f"mount: {exc.strerror}") from None
                fd = fusermount(self.mountpoint, self.fsname, read_only=self.read_only, allow_other=self.allow_other)
        except MountError as exc:
            reason = fuse_failure_reason(exc.strerror or "") or "refused"
            raise OSError(exc.errno or errno.EIO, f"cannot mount on {self.mountpoint}: {reason}") from None
        self.fd = fd

    def terminate(self) -> None:
        """End ``serve`` (the mount stays until ``close``)."""
        self._end()

    def close(self) -> None:
        """Make sure the mount is gone (unless it was handed over) and close the descriptor."""
        if self._closed:
            return
        self._closed = True
        self._close_writers()
        if self.notifier is not None:
            self.notifier.close()
        unmounted = not self.handed_over and self.fd >= 0
        if unmounted:
            unmount(self.mountpoint, privileged=self.privileged)
        if self._broker_client is not None:
            self._broker_client.shutdown()
        if self._readers and not self._readers_joined(READER_JOIN_S if unmounted else 0.0):
            # A reader is still blocked reading a descriptor (a busy mount detached lazily, or a
            # handed-over one): closing it under the thread could hand its number to another file.
            # They go with the process.
            log.info("FUSE readers still wait on %s; its descriptors close when the daemon exits", self.mountpoint)
            return
        for fd in self._clones:
            os.close(fd)
        if self.fd >= 0:
            os.close(self.fd)

    def _readers_joined(self, timeout_s: float) -> bool:
        loop = self._loop
        held = isinstance(loop, SharedLoop) and loop.in_loop_thread()
        if held:
            loop.state_lock.release()  # type: ignore[union-attr]  # (a reader may need it to finish)
        try:
            deadline = time.monotonic() + timeout_s
            for reader in self._readers:
                reader.join(max(0.0, deadline - time.monotonic()))
        finally:
            if held:
                loop.state_lock.acquire()  # type: ignore[union-attr]
        return not any(reader.is_alive() for reader in self._readers)

    # ------------------------------------------------------------------------------------- serving
    async def serve(self, max_tasks: int) -> None:
        """Serve requests until the filesystem is unmounted or ``terminate`` is called."""
        self._loop = asyncio.get_running_loop()
        self._ended = self._loop.create_future()
        self._max_tasks = max(1, max_tasks)
        os.set_blocking(self.fd, False)
        self._writers = ReplyWriters(self.fd, self._gone_from_thread)
        self._poller = select.poll()
        self._poller.register(self.fd, select.POLLIN)
        self._resume()
        try:
            await self._ended
        finally:
            self._pause()
            tasks = [task for task, _ in self._tasks.values()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
            await asyncio.to_thread(self._close_writers)

    @property
    def offloaded_replies(self) -> int:
        """Replies written by a writer thread so far."""
        return self._writers.offloaded if self._writers is not None else 0

    def _close_writers(self) -> None:
        if self._writers is not None:
            self._writers.close()

    def _gone_from_thread(self) -> None:
        """A writer thread found the connection gone (ENODEV): end the session on the loop."""
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._end)
            except RuntimeError:  # the loop closed in between: serve has ended anyway
                pass

    def _resume(self) -> None:
        if self._threaded:
            return
        if not self._reading and self._loop is not None and not self._ended.done():  # type: ignore[union-attr]
            self._loop.add_reader(self.fd, self._readable)
            self._reading = True

    def _pause(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self.fd)
            self._reading = False

    def _end(self) -> None:
        self._pause()
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)
        if self._room is not None:
            self._room.notify_all()  # readers waiting for room see the end

    def _readable(self) -> None:
        for i in range(READS_PER_WAKEUP):
            # After the first request, look before reading: a read that finds nothing raises
            # BlockingIOError (0.77 us measured here, against 0.26 us for a poll), and one client
            # waiting for its reply leaves nothing behind it most of the time.
            if i and not self._poller.poll(0):
                return
            if len(self._tasks) >= self._max_tasks:
                self._pause()  # resumed when a task ends
                return
            try:
                length = os.readv(self.fd, [self._buffer])
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # the request was interrupted before it was read
                    continue
                if exc.errno != errno.ENODEV:  # ENODEV: unmounted
                    log.error("reading %s failed: %s; the session ends", FUSE_DEVICE, exc)
                self._end()
                return
            if length == 0:  # end of file: the connection is gone
                self._end()
                return
            self._buffer = self._dispatch(self.fd, self._buffer, length)
            if self._ended is None or self._ended.done() or self._threaded:
                return

    def _dispatch(self, fd: int, buffer: bytearray, length: int, later: list[Buffer] | None = None,
                  off_lock: list[tuple[Request, OffLock]] | None = None) -> bytearray:
        """Answer, or start answering, the request of ``length`` bytes read from ``fd`` into
        ``buffer``; the buffer the next read of ``fd`` goes into. With ``later`` and ``off_lock`` (a
        reader thread), an inline answer's buffers are put in ``later``, for the caller to write once
        it has let go of the state lock, instead of being written now, and an ``OffLock`` with its
        request in ``off_lock``, for the caller to run without the lock (``_finish_off_lock``)."""
        try:
            req = _parse_request(memoryview(buffer)[:length])
        except (ValueError, struct.error):
            log.error("a request of %d bytes could not be decoded; ignored", length)
            return buffer
        opcode = req.opcode
        if opcode < REQUEST_COUNTS:
            self.requests[opcode] += 1
        inline = (self._inline if off_lock is None else self._reader_inline).get(opcode)
        if inline is not None:
            try:
                reply = inline(req)
            except FuseError as exc:
                self.send(req.unique, exc.errno, fd=fd)
                return buffer
            except Exception as exc:  # noqa: BLE001 - the adapter decides the errno (and logs bugs)
                self.send(req.unique, self.ops.failure(opcode, exc), fd=fd)
                return buffer
            if reply is LATER:
                return self._start(req, self.ops.handlers[opcode], fd, buffer)
            if isinstance(reply, OffLock):
                assert off_lock is not None  # (only ``reader_inline`` handlers return one)
                off_lock.append((req, reply))  # the request stays in ``buffer`` until it is finished
                return buffer
            if opcode in NO_REPLY:
                return buffer
            # The usual inline answers (an entry, attributes, an open, an xattr; nothing, for a
            # release) are written here, in one writev, without send()'s checks.
            if reply is None:
                out: tuple[Buffer, ...] = (_OUT_HEADER_PACK(_OUT_HEADER_SIZE, 0, req.unique),)
            elif reply.__class__ is bytes and len(reply) < OFFLOAD_MIN_BYTES:
                out = (_OUT_HEADER_PACK(_OUT_HEADER_SIZE + len(reply), 0, req.unique), reply)
            else:
                self.send(req.unique, 0, reply, fd=fd)  # type: ignore[arg-type]
                return buffer
            if self._closed:
                return buffer
            if later is not None:
                later += out
                return buffer
            try:
                _writev(fd, out)
            except OSError as exc:
                reply_failed(exc, self._end)
            return buffer
        handler = self.ops.handlers.get(opcode)
        if handler is not None:
            return self._start(req, handler, fd, buffer)
        if opcode == wire.INIT:
            self._init(req)
        elif opcode == wire.INTERRUPT:
            self._interrupt(wire.INTERRUPT_IN.unpack_from(req.body)[0])
        elif opcode == wire.DESTROY:
            self.send(req.unique, 0, fd=fd)
            self._end()
        elif opcode not in NO_REPLY:
            self.send(req.unique, errno.ENOSYS, fd=fd)
        return buffer

    def _finish_off_lock(self, req: Request, work: OffLock, fd: int, buffer: bytearray,
                         later: list[Buffer]) -> bytearray:
        """With the state lock again, after ``work.run()``: its answer's buffers go in ``later``, which
        the reader writes before its next read (never a writer thread: the reply may be a view of the
        reader's own buffer), or its ``LATER`` starts the request's handler."""
        try:
            reply = work.finish()
        except FuseError as exc:
            self.send(req.unique, exc.errno, fd=fd)
            return buffer
        except Exception as exc:  # noqa: BLE001 - the adapter decides the errno (and logs bugs)
            self.send(req.unique, self.ops.failure(req.opcode, exc), fd=fd)
            return buffer
        if reply is LATER:
            return self._start(req, self.ops.handlers[req.opcode], fd, buffer)
        if self._closed:
            return buffer
        if reply is None:
            later.append(_OUT_HEADER_PACK(_OUT_HEADER_SIZE, 0, req.unique))
        elif isinstance(reply, (bytes, bytearray, memoryview)):
            later += (_OUT_HEADER_PACK(_OUT_HEADER_SIZE + len(reply), 0, req.unique), reply)
        else:
            assert not isinstance(reply, Later)
            later += (_OUT_HEADER_PACK(_OUT_HEADER_SIZE + sum(len(part) for part in reply), 0, req.unique), *reply)
        return buffer

    def _start(self, req: Request, handler: Callable[[Request], Awaitable[Reply]], fd: int,
               buffer: bytearray) -> bytearray:
        if self._threaded and req.unique in self._early:
            del self._early[req.unique]  # its interrupt was read first, by another reader
            if req.opcode in INTERRUPTIBLE:
                self.send(req.unique, errno.EINTR, fd=fd)
                return buffer
        held = None
        if req.opcode == wire.WRITE:
            # The payload stays where it was read; the next request goes into another buffer.
            held = buffer
            buffer = self._spare.pop() if self._spare else bytearray(BUFFER_SIZE)
        else:
            req = req._replace(body=memoryview(req.body.tobytes()))
        loop = self._loop
        assert loop is not None
        coro = self._run(req, handler, held, fd)
        if self._threaded and isinstance(loop, SharedLoop):
            # A reader thread: the handler runs here until it first waits (a warm request never
            # does), then on as a task of the loop.
            loop.start_task(coro, lambda task: self._tasks.__setitem__(req.unique, (task, req.opcode)))
        else:
            self._tasks[req.unique] = (loop.create_task(coro), req.opcode)
        return buffer

    async def _run(self, req: Request, handler: Callable[[Request], Awaitable[Reply]], held: bytearray | None,
                   fd: int) -> None:
        unique = req.unique
        try:
            reply = await handler(req)
        except FuseError as exc:
            self.send(unique, exc.errno, fd=fd)
        except asyncio.CancelledError:
            if unique in self._interrupted:
                self.send(unique, errno.EINTR, fd=fd)
            else:
                raise  # the session ends
        except Exception as exc:  # noqa: BLE001 - the adapter decides the errno (and logs bugs)
            self.send(unique, self.ops.failure(req.opcode, exc), fd=fd)
        else:
            self.send(unique, 0, reply, fd=fd)
        finally:
            self._tasks.pop(unique, None)
            self._interrupted.discard(unique)
            if held is not None and len(self._spare) < SPARE_BUFFERS:
                self._spare.append(held)
            if self._room is not None:
                self._room.notify()
            elif not self._reading and len(self._tasks) < self._max_tasks:
                self._resume()

    def _interrupt(self, unique: int) -> None:
        entry = self._tasks.get(unique)
        if entry is not None:
            if entry[1] in INTERRUPTIBLE:
                self._interrupted.add(unique)
                entry[0].cancel()
        elif self._threaded:
            # Its request may have been read by another reader that has not started it yet.
            self._early[unique] = None
            if len(self._early) > EARLY_INTERRUPTS:
                del self._early[next(iter(self._early))]

    # ------------------------------------------------------------------------------ several readers
    def _start_readers(self) -> None:
        """After INIT: one reader thread per descriptor, the session's and ``threads - 1`` clones (those
        handed over first, then its own). Where the loop cannot be shared or no clone can be made, the
        loop reads alone, as before."""
        loop = self._loop
        if not isinstance(loop, SharedLoop):
            log.warning("--fuse-threads %d needs the daemon's shared loop; the loop reads every request",
                        self.threads)
            return
        fds = [self.fd, *self._clones[:self.threads - 1]]
        for fd in self._clones[self.threads - 1:]:
            os.close(fd)
        for _ in range(self.threads - len(fds)):
            try:
                fds.append(clone_device(self.fd))
            except OSError as exc:
                # (INFO: a handed-over mount's pod often has no /dev/fuse, and may serve without it)
                log.info("cannot clone the FUSE descriptor (%s); %d reader(s) serve the mount",
                         exc.strerror or exc, len(fds))
                break
        self._clones = fds[1:]
        if len(fds) == 1:
            return
        self._pause()
        self._threaded = True
        self._room = threading.Condition(loop.state_lock)
        for fd in fds:
            self._add_reader(loop, fd)
        loop.call_later(STALL_CHECK_S, self._watch_stalls, loop)
        log.info("%d threads read the mount's requests", len(fds))

    def _add_reader(self, loop: SharedLoop, fd: int) -> None:
        self._readers_left += 1
        reader = threading.Thread(target=self._reader, args=(loop, fd), name=f"fuse-reader-{len(self._readers)}",
                                  daemon=True)
        self._readers.append(reader)
        reader.start()

    def _watch_stalls(self, loop: SharedLoop) -> None:
        """On the loop: a reader whose blocking work has run ``STALL_S`` is replaced on its descriptor
        by a new reader, once, and the work is told; the reader ends when the work returns."""
        if self._ended is None or self._ended.done():
            return
        now = time.monotonic()
        for ident, (since, work, fd) in list(self._stalls.items()):
            if now - since >= STALL_S and ident not in self._replaced:
                self._replaced.add(ident)
                log.error("a FUSE reader's disk read has not returned for %.0f s; another reader serves the "
                          "mount, and the disk tier is skipped", now - since)
                try:
                    work.stalled(now - since)
                except Exception:  # noqa: BLE001 - the mount must go on serving whatever this raises
                    log.exception("telling stalled work failed")
                self._add_reader(loop, fd)
        loop.call_later(STALL_CHECK_S, self._watch_stalls, loop)

    def _reader(self, loop: SharedLoop, fd: int) -> None:
        """One reader: blocks in ``readv`` (the GIL and the state lock released), then answers with
        the state lock held, as the loop would; a handler that waits goes on as a task of the loop,
        which answers on ``fd`` (so ``close`` closes the clones, once the tasks are gone).

        Every reader reads, and the kernel hands each request to the one that has waited longest, so
        idle readers take turns. Tried and measured worse: only the first reader reading while
        nothing waits (the others parked on a condition until a task or a disk read was in flight).
        A warm file's OPEN and RELEASE cost 10% less that way, but a client's back-to-back requests
        cost twice as much (GETXATTR: 30-31 us against 14.6-14.7, quiet 2-CPU VM): one thread that
        sleeps between every two requests pays a whole wake-up each time, where two readers taking
        turns find the next request queued often enough (0.67 sleeps per request each)."""
        asyncio.events._set_running_loop(loop)  # what handlers and the tasks they make expect to see
        os.set_blocking(fd, True)
        lock = loop.state_lock
        acquire, release = lock.acquire, lock.release
        room = self._room
        assert room is not None and self._ended is not None
        buffer = bytearray(BUFFER_SIZE)
        later: list[Buffer] = []  # an inline answer, written once the state lock is let go of
        off_lock: list[tuple[Request, OffLock]] = []  # an inline answer's blocking work, run without the lock
        ident, stalls = threading.get_ident(), self._stalls
        try:
            while not self._ended.done():
                if len(self._tasks) >= self._max_tasks:
                    with loop.holding_state():  # (counted as waiting: a busy loop lets go)
                        while len(self._tasks) >= self._max_tasks and not self._ended.done():
                            room.wait()
                try:
                    length = os.readv(fd, [buffer])
                except OSError as exc:
                    if exc.errno == errno.ENOENT:  # the request was interrupted before it was read
                        continue
                    if exc.errno != errno.ENODEV:  # ENODEV: unmounted, every reader sees it
                        log.error("reading %s failed: %s; the session ends", FUSE_DEVICE, exc)
                        loop.call_soon_threadsafe(self._end)
                    return
                if length == 0:  # end of file: the connection is gone
                    return
                if not acquire(False):  # (uncontended, the usual case: no count of waiters kept)
                    loop.wait_for_state()
                try:
                    if self._ended.done():
                        return  # (the session is ending: what is read now is left to the kernel's abort)
                    buffer = self._dispatch(fd, buffer, length, later, off_lock)
                    wake = loop.take_wake()
                finally:
                    release()
                if off_lock:
                    req, job = off_lock.pop()
                    stalls[ident] = (time.monotonic(), job, fd)
                    job.run()  # (the GIL let go of in its I/O; the request is still in ``buffer``)
                    del stalls[ident]
                    if not acquire(False):
                        loop.wait_for_state()
                    try:
                        if self._ended.done():
                            return
                        buffer = self._finish_off_lock(req, job, fd, buffer, later)
                        wake = loop.take_wake() or wake
                    finally:
                        release()
                if later:
                    # An inline answer, written with the lock free: a reader the next request wakes
                    # while this writev lets go of the GIL must not find the lock held and sleep again.
                    try:
                        _writev(fd, later)
                    except OSError as exc:
                        reply_failed(exc, self._gone_from_thread)
                    later.clear()
                if wake:
                    loop.wake()
                if ident in self._replaced:
                    self._replaced.discard(ident)  # (a later thread may get the same id)
                    return  # (its work stalled: another reader took this descriptor over)
        finally:
            with contextlib.suppress(RuntimeError):  # (the loop is closed: the daemon is ending anyway)
                loop.call_soon_threadsafe(self._reader_ended)

    def _reader_ended(self) -> None:
        self._readers_left -= 1
        if self._readers_left == 0:
            self._end()  # every reader saw the end of the connection

    def _init(self, req: Request) -> None:
        init = wire.parse_init(req.body)
        if init.major > wire.KERNEL_MAJOR:
            # The kernel speaks a newer major: answer with ours, and it sends INIT again in that one.
            self.send(req.unique, 0, wire.init_out(minor=wire.KERNEL_MINOR, max_readahead=0, flags=0,
                                                   max_background=0, congestion_threshold=0, max_write=0,
                                                   max_pages=0))
            return
        if init.major < wire.KERNEL_MAJOR or init.minor < wire.MIN_KERNEL_MINOR:
            log.error("the kernel speaks FUSE %d.%d; cachefs needs %d.%d (Linux 3.15) or later", init.major,
                      init.minor, wire.KERNEL_MAJOR, wire.MIN_KERNEL_MINOR)
            self.send(req.unique, errno.EPROTO)
            self._end()
            return
        flags = init.flags & (WANTED_FLAGS | self.ops.wanted_flags)
        backing: Backing | None = None
        if self.ops.wanted_flags & wire.PASSTHROUGH:
            if not flags & wire.PASSTHROUGH:
                log.info("passthrough: the kernel does not offer it (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH); "
                         "the daemon serves every read")
            else:
                backing = self._backing()
                if backing is None:
                    flags &= ~wire.PASSTHROUGH
        self.proto_minor = min(init.minor, wire.KERNEL_MINOR)
        self.flags = flags
        if self.notifier is None and self.proto_minor >= wire.NOTIFY_INVAL_MIN_MINOR:
            self.notifier = Notifier(self.fd)
        self.ops.negotiated(flags, backing, self.notifier)
        if self.threads > 1:
            self._start_readers()  # (before the answer: the kernel sends nothing else until it has it)
        self.send(req.unique, 0, wire.init_out(
            minor=self.proto_minor, max_readahead=init.max_readahead, flags=flags,
            max_background=FUSE_MAX_BACKGROUND, congestion_threshold=FUSE_CONGESTION_THRESHOLD,
            max_write=MAX_WRITE, max_pages=MAX_PAGES if flags & wire.MAX_PAGES else 0,
            max_stack_depth=PASSTHROUGH_STACK_DEPTH if flags & wire.PASSTHROUGH else 0))
        log.debug("FUSE %d.%d, flags %#x of %#x offered", wire.KERNEL_MAJOR, init.minor, flags, init.flags)

    def _backing(self) -> Backing | None:
        """Who registers backing files for this connection: this process where it may, else the node
        plugin's broker if it answers a probe (bounded: ``cachefs.backing.BROKER_TIMEOUT_S``), else
        nobody (one log line; the daemon serves every read)."""
        if may_register_backing():
            return BackingFiles(self.fd)
        if self.broker is None:
            log.info("passthrough: not used, registering backing files needs CAP_SYS_ADMIN in the initial "
                     "user namespace; the daemon serves every read")
            return None
        client = BrokerBackingFiles(self.broker, self.fd)
        try:
            client.probe()
        except BrokerError as exc:
            log.warning("passthrough: not used, %s; the daemon serves every read", exc.strerror)
            return None
        log.info("passthrough: backing files are registered by the node plugin's broker %s", self.broker)
        self._broker_client = client
        return client

    def send(self, unique: int, error: int, reply: Reply = None, fd: int | None = None) -> None:
        """Answer request ``unique``: ``error`` (a positive errno), or 0 and the reply's buffers, on the
        descriptor the request was read from (``fd``; the session's by default): each clone of the
        connection has its own list of requests awaiting an answer."""
        if self._closed:
            return
        if error or reply is None:
            buffers: list[Buffer] = [_OUT_HEADER_PACK(_OUT_HEADER_SIZE, -error, unique)]
        elif isinstance(reply, (bytes, bytearray, memoryview)):
            buffers = [_OUT_HEADER_PACK(_OUT_HEADER_SIZE + len(reply), 0, unique), reply]
            if len(reply) >= OFFLOAD_MIN_BYTES and self._writers is not None and self._writers.submit(buffers, fd):
                return
        else:
            size = sum(len(part) for part in reply)
            buffers = [_OUT_HEADER_PACK(_OUT_HEADER_SIZE + size, 0, unique), *reply]
            if size >= OFFLOAD_MIN_BYTES and self._writers is not None and self._writers.submit(buffers, fd):
                return
        try:
            _writev(self.fd if fd is None else fd, buffers)
        except OSError as exc:
            reply_failed(exc, self._end)
