"""Several readers of one FUSE connection (cachefs.fuse.session with ``threads`` > 1 on a SharedLoop),
at the protocol level, with no mount: the test plays the kernel on SOCK_SEQPACKET socket pairs, which
keep each request and each reply one message as /dev/fuse does, and stand in for the session's
descriptor and its clones (``clone_device`` is replaced; each pair is then its own queue, so the test
chooses which reader gets which request).

What is checked: INIT is read on the session's descriptor only, and only then are the clones made;
every reply goes back on the descriptor its request came from; a handler that never waits is
answered by the reader thread itself, and one that waits goes on as a task of the loop; an
INTERRUPT read by one reader cancels a request read by another, whichever is read first; FORGET
gets no reply; the end of every descriptor ends ``serve``."""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cachefs.cli.main import build_parser
from cachefs.cli.mount import mount_settings
from cachefs.client import UsageError
from cachefs.fuse import session as fuse_session
from cachefs.fuse import wire
from cachefs.fuse.sharedloop import SharedLoop
from cachefs.settings import DEFAULT_FUSE_THREADS, MountSettings

WAIT_S = 10.0


def request(opcode: int, unique: int, body: bytes = b"", nodeid: int = 1) -> bytes:
    return wire.IN_HEADER.pack(wire.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 0, 0, 0) + body


def read_reply(sock: socket.socket) -> tuple[int, int, bytes]:
    """(unique, error, payload) of the next reply on ``sock``; fails after WAIT_S."""
    sock.settimeout(WAIT_S)
    data = sock.recv(1 << 20)
    length, error, unique = wire.OUT_HEADER.unpack_from(data)
    assert length == len(data)
    return unique, -error, data[wire.OUT_HEADER.size:]


async def initialised(kernel: socket.socket) -> None:
    """Send INIT (protocol 7.31) as the kernel and check it is answered without an error."""
    await asyncio.to_thread(kernel.send, request(wire.INIT, 1, wire.INIT_IN.pack(7, 31, 0, 0)))
    assert (await asyncio.to_thread(read_reply, kernel))[:2] == (1, 0)


class Ops:
    """GETATTR answers at once (saying which thread ran it), READ waits for ``release_reads``,
    LOOKUP waits until cancelled, FORGET is counted."""

    wanted_flags = 0

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.forgotten: list[int] = []
        self.release_reads = asyncio.Event()
        self.inline = {wire.FORGET: self.forget, wire.GETXATTR: self.getxattr, wire.RELEASE: self.release}
        self.handlers = {wire.GETATTR: self.getattr, wire.READ: self.read, wire.LOOKUP: self.lookup,
                         wire.OPEN: self.open}
        self.reader_inline = {wire.READ: self.read_off_lock}
        self.off_lock_runs: list[tuple[str, bool]] = []  # (thread, whether it could take the state lock)
        self.stalled: list[tuple[int, float]] = []  # (nodeid, seconds) of the work told it stalled
        self.unhang = threading.Event()
        self.state_lock: threading.Lock | None = None

    def negotiated(self, flags: int, backing: object, notifier: object = None) -> None:
        self.flags = flags

    def failure(self, opcode: int, exc: BaseException) -> int:
        return errno.EIO

    def forget(self, req: wire.Request) -> None:
        self.forgotten.append(req.nodeid)

    def getxattr(self, req: wire.Request) -> bytes:
        return b"value of %d" % req.nodeid

    def release(self, req: wire.Request) -> None:
        return None

    async def getattr(self, req: wire.Request) -> bytes:
        self.threads.append(threading.current_thread().name)
        return struct.pack("<Q", req.nodeid)

    def read_off_lock(self, req: wire.Request) -> object:
        """A READ of nodeid 70 is answered by blocking work (``OffLock``); 71's work then asks for the
        task (LATER); any other READ goes to ``read`` at once."""
        if req.nodeid not in (70, 71, 72):
            return fuse_session.LATER
        ops, nodeid = self, req.nodeid

        class Work(fuse_session.OffLock):
            def stalled(self, seconds: float) -> None:
                ops.stalled.append((nodeid, seconds))

            def run(self) -> None:
                if nodeid == 72:  # a disk read that hangs until the test lets it go
                    ops.off_lock_runs.append((threading.current_thread().name, ops.unhang.wait(WAIT_S)))
                    return
                lock = ops.state_lock
                assert lock is not None
                deadline = time.monotonic() + WAIT_S  # the loop may hold it a moment; the reader must not
                while not lock.acquire(False):
                    if time.monotonic() > deadline:
                        ops.off_lock_runs.append((threading.current_thread().name, False))
                        return
                    time.sleep(0.001)
                lock.release()
                ops.off_lock_runs.append((threading.current_thread().name, True))

            def finish(self) -> object:
                return b"off the lock %d" % nodeid if nodeid in (70, 72) else fuse_session.LATER

        return Work()

    async def read(self, req: wire.Request) -> bytes:
        await self.release_reads.wait()
        self.threads.append(threading.current_thread().name)
        return b"read %d" % req.nodeid

    async def open(self, req: wire.Request) -> bytes:
        """What the engine's calls do on their way: a deadline (which needs the current task) and a
        timer set by the thread that took the first step, which the loop must then see."""
        first = threading.current_thread().name
        async with asyncio.timeout(WAIT_S):
            await asyncio.sleep(0.05)
        return f"{first} then {threading.current_thread().name}".encode()

    async def lookup(self, req: wire.Request) -> bytes:
        await asyncio.Event().wait()
        raise AssertionError("not reached")


class Kernel:
    """The session on its own SharedLoop thread, three readers: the session's pair and two clones."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(3)]
        self.kernel = [k for k, _ in pairs]
        self.daemon_fds = [d.detach() for _, d in pairs]
        clones = iter(self.daemon_fds[1:])
        self.cloned_from: list[int] = []

        def clone_device(session_fd: int) -> int:
            self.cloned_from.append(session_fd)
            return next(clones)

        monkeypatch.setattr(fuse_session, "clone_device", clone_device)
        self.ops = Ops()
        self.session = fuse_session.FuseSession(self.ops, "/unused", fd=self.daemon_fds[0], threads=3)  # type: ignore[arg-type]
        self.loop: SharedLoop | None = None
        self.served = threading.Event()
        self.thread = threading.Thread(target=self._run, name="loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=SharedLoop) as runner:
            self.loop = runner.get_loop()  # type: ignore[assignment]
            self.ops.state_lock = self.loop.state_lock  # type: ignore[union-attr]
            runner.run(self.session.serve(8))
            self.session.close()
        self.served.set()

    def send(self, reader: int, data: bytes) -> None:
        self.kernel[reader].send(data)

    def end(self) -> None:
        for sock in self.kernel:
            sock.close()


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Kernel]:
    k = Kernel(monkeypatch)
    try:
        k.send(0, request(wire.INIT, 1, wire.INIT_IN.pack(7, 31, 1 << 20, wire.ASYNC_READ)))
        unique, error, payload = read_reply(k.kernel[0])
        assert (unique, error) == (1, 0) and wire.INIT_OUT.unpack_from(payload)[:2] == (7, 31)
        yield k
    finally:
        k.end()
        assert k.served.wait(WAIT_S), "serve did not end when every descriptor ended"


def test_init_on_the_session_descriptor_then_clones_of_it(kernel: Kernel) -> None:
    assert kernel.cloned_from == [kernel.daemon_fds[0]] * 2
    assert kernel.session._threaded


def test_each_reply_goes_back_on_the_descriptor_its_request_came_from(kernel: Kernel) -> None:
    for reader in (2, 0, 1, 1, 2):
        unique = 10 + 2 * reader
        kernel.send(reader, request(wire.GETATTR, unique, wire.GETATTR_IN.pack(0, 0, 0), nodeid=100 + reader))
        assert read_reply(kernel.kernel[reader]) == (unique, 0, struct.pack("<Q", 100 + reader))
    # Answered by the reader threads themselves: the loop's thread never ran them.
    assert set(kernel.ops.threads) == {"fuse-reader-0", "fuse-reader-1", "fuse-reader-2"}


def test_a_handler_that_waits_goes_on_as_a_task_of_the_loop(kernel: Kernel) -> None:
    kernel.send(1, request(wire.READ, 20, wire.READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), nodeid=7))
    kernel.send(2, request(wire.GETATTR, 22, wire.GETATTR_IN.pack(0, 0, 0), nodeid=8))
    assert read_reply(kernel.kernel[2]) == (22, 0, struct.pack("<Q", 8))  # not held up by the waiting READ
    wait_until(lambda: 20 in kernel.session._tasks)  # the READ waits (its reader may start it after the GETATTR)
    assert kernel.loop is not None
    kernel.loop.call_soon_threadsafe(kernel.ops.release_reads.set)
    assert read_reply(kernel.kernel[1]) == (20, 0, b"read 7")
    assert kernel.ops.threads[-1] == "loop"


def test_blocking_work_runs_in_the_reader_without_the_state_lock(kernel: Kernel) -> None:
    """An ``OffLock`` (a disk-tier READ) is run by the reader that read its request, with the loop's
    state lock let go of, and its reply goes back on that reader's descriptor."""
    kernel.send(2, request(wire.READ, 70, wire.READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), nodeid=70))
    assert read_reply(kernel.kernel[2]) == (70, 0, b"off the lock 70")
    assert kernel.ops.off_lock_runs == [("fuse-reader-2", True)]


def test_a_reader_whose_disk_read_hangs_is_replaced_and_the_work_told(kernel: Kernel,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung device must not take the mount with it: the reader stuck in its blocking work past
    ``STALL_S`` is replaced on its descriptor by a new reader (the next request there is answered), the
    work is told once (the disk tier then goes down), and the stuck reader answers its own request
    and ends when its work returns."""
    monkeypatch.setattr(fuse_session, "STALL_S", 0.3)
    monkeypatch.setattr(fuse_session, "STALL_CHECK_S", 0.05)
    kernel.send(2, request(wire.READ, 72, wire.READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), nodeid=72))
    wait_until(lambda: kernel.ops.stalled != [])  # (the first check comes within a second: its old period)
    assert [nodeid for nodeid, _ in kernel.ops.stalled] == [72] and kernel.ops.stalled[0][1] >= 0.3
    stuck = next(t for t in kernel.session._readers if t.name == "fuse-reader-2")
    kernel.send(2, request(wire.READ, 70, wire.READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), nodeid=70))
    assert read_reply(kernel.kernel[2]) == (70, 0, b"off the lock 70")  # the new reader's answer
    assert kernel.ops.off_lock_runs == [("fuse-reader-3", True)]
    time.sleep(0.3)
    assert len(kernel.ops.stalled) == 1  # told once, not at every check
    kernel.ops.unhang.set()
    assert read_reply(kernel.kernel[2]) == (72, 0, b"off the lock 72")  # the stuck reader's own answer
    stuck.join(WAIT_S)
    assert not stuck.is_alive()  # it ended: one reader per descriptor again
    kernel.send(2, request(wire.GETXATTR, 74, b"", nodeid=9))
    assert read_reply(kernel.kernel[2]) == (74, 0, b"value of 9")


def test_blocking_work_that_finds_nothing_goes_on_as_the_requests_task(kernel: Kernel) -> None:
    """``finish`` answering LATER (a disk-tier miss) runs the request's ordinary handler."""
    assert kernel.loop is not None
    kernel.loop.call_soon_threadsafe(kernel.ops.release_reads.set)
    kernel.send(1, request(wire.READ, 71, wire.READ_IN.pack(1, 0, 4096, 0, 0, 0, 0), nodeid=71))
    assert read_reply(kernel.kernel[1]) == (71, 0, b"read 71")
    assert kernel.ops.off_lock_runs == [("fuse-reader-1", True)]


def test_a_first_step_in_a_reader_is_a_task_step_with_deadlines_and_timers(kernel: Kernel) -> None:
    kernel.send(2, request(wire.OPEN, 60, wire.OPEN_IN.pack(0, 0)))
    assert read_reply(kernel.kernel[2]) == (60, 0, b"fuse-reader-2 then loop")


def test_an_interrupt_read_by_another_reader_cancels_the_request(kernel: Kernel) -> None:
    kernel.send(0, request(wire.LOOKUP, 30, b"name\0"))
    # Wait until the LOOKUP is a task of the loop, then interrupt it through another descriptor.
    wait_until(lambda: 30 in kernel.session._tasks)
    kernel.send(2, request(wire.INTERRUPT, 32, wire.INTERRUPT_IN.pack(30)))
    assert read_reply(kernel.kernel[0]) == (30, errno.EINTR, b"")


def test_an_interrupt_read_before_its_request_answers_it_with_eintr(kernel: Kernel) -> None:
    kernel.send(2, request(wire.INTERRUPT, 41, wire.INTERRUPT_IN.pack(40)))
    wait_until(lambda: 40 in kernel.session._early)
    kernel.send(1, request(wire.LOOKUP, 40, b"name\0"))
    assert read_reply(kernel.kernel[1]) == (40, errno.EINTR, b"")
    assert 40 not in kernel.session._tasks


def test_forget_gets_no_reply_on_any_reader(kernel: Kernel) -> None:
    kernel.send(1, request(wire.FORGET, 50, wire.FORGET_IN.pack(1), nodeid=9))
    kernel.send(1, request(wire.GETATTR, 52, wire.GETATTR_IN.pack(0, 0, 0), nodeid=3))
    assert read_reply(kernel.kernel[1])[0] == 52  # the next reply on that descriptor is the GETATTR's
    assert kernel.ops.forgotten == [9]


def test_an_inline_answer_is_one_writev_made_with_the_state_lock_free(kernel: Kernel,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer that needed no waiting is written by its reader in one writev of the header and the
    payload, once the reader has let go of the state lock: a reader woken by the next request while
    that writev has the GIL released must not find the lock held and sleep once more for it."""
    assert kernel.loop is not None
    lock = kernel.loop.state_lock
    writes: list[tuple[str, int, bytes, bool]] = []
    real = fuse_session._writev

    def recording(fd: int, buffers: list[bytes]) -> int:
        writes.append((threading.current_thread().name, fd, b"".join(buffers), lock.locked()))
        return real(fd, buffers)

    monkeypatch.setattr(fuse_session, "_writev", recording)
    kernel.send(1, request(wire.GETXATTR, 70, wire.GETXATTR_IN.pack(64, 0) + b"user.x\0", nodeid=5))
    assert read_reply(kernel.kernel[1]) == (70, 0, b"value of 5")
    kernel.send(2, request(wire.RELEASE, 72, wire.RELEASE_IN.pack(3, 0, 0, 0), nodeid=5))
    assert read_reply(kernel.kernel[2]) == (72, 0, b"")
    # (The loop's thread is idle meanwhile: nothing was scheduled for it, so it does not hold the lock.)
    assert writes == [("fuse-reader-1", kernel.daemon_fds[1], wire.OUT_HEADER.pack(16 + 10, 0, 70) + b"value of 5", False),
                      ("fuse-reader-2", kernel.daemon_fds[2], wire.OUT_HEADER.pack(16, 0, 72), False)]


def wait_until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_without_a_shared_loop_the_loop_reads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session asked for threads on an ordinary loop (a test, an embedding) serves as before."""
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setattr(fuse_session, "clone_device", lambda fd: pytest.fail("cloned without a shared loop"))
    session = fuse_session.FuseSession(Ops(), "/unused", fd=daemon.detach(), threads=2)  # type: ignore[arg-type]

    async def main() -> None:
        serving = asyncio.create_task(session.serve(4))
        await initialised(kernel)
        await asyncio.to_thread(kernel.send, request(wire.GETATTR, 2, wire.GETATTR_IN.pack(0, 0, 0), nodeid=5))
        assert await asyncio.to_thread(read_reply, kernel) == (2, 0, struct.pack("<Q", 5))
        kernel.close()
        await asyncio.wait_for(serving, WAIT_S)

    asyncio.run(main())
    session.close()
    assert not session._threaded


def test_the_option_reaches_the_settings_and_bad_values_are_refused(tmp_path: Path) -> None:
    def settings(*extra: str) -> MountSettings:
        argv = ["mount", "s3://bucket", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--read-only", *extra]
        return mount_settings(build_parser().parse_args(argv), {})

    assert settings().fuse_threads == DEFAULT_FUSE_THREADS
    assert settings("--fuse-threads", "4").fuse_threads == 4
    for bad in ("0", "33"):
        with pytest.raises(UsageError, match=f"--fuse-threads {bad} must be between 1 and 32"):
            settings("--fuse-threads", bad)


def test_where_no_clone_can_be_made_the_loop_reads_alone(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A mount pod that may not open /dev/fuse (a CSI handover to an unprivileged daemon): one line
    says so, and the loop serves every request on the session's descriptor, as before."""
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def refused(fd: int) -> int:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fuse_session, "clone_device", refused)
    session = fuse_session.FuseSession(Ops(), "/unused", fd=daemon.detach(), threads=3)  # type: ignore[arg-type]

    async def main() -> None:
        serving = asyncio.create_task(session.serve(4))
        await initialised(kernel)
        await asyncio.to_thread(kernel.send, request(wire.GETATTR, 2, wire.GETATTR_IN.pack(0, 0, 0), nodeid=5))
        assert await asyncio.to_thread(read_reply, kernel) == (2, 0, struct.pack("<Q", 5))
        kernel.close()
        await asyncio.wait_for(serving, WAIT_S)

    with asyncio.Runner(loop_factory=SharedLoop) as runner, caplog.at_level("INFO"):
        runner.run(main())
        session.close()
    assert not session._threaded
    assert "cannot clone the FUSE descriptor (Permission denied); 1 reader(s) serve the mount" in caplog.text


def test_clones_handed_over_with_the_descriptor_are_read_before_any_is_made(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A mount pod cannot open /dev/fuse, so the node plugin hands its daemon clones with the mounted
    descriptor (cachefs.handover): the session reads them, one reader each, and makes none itself;
    a reply goes back on the handed-over clone its request came from."""
    kernel, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    clone_kernel, clone_daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def refused(fd: int) -> int:
        raise OSError(errno.ENOENT, "No such file or directory")  # (a pod's /dev has no fuse)

    monkeypatch.setattr(fuse_session, "clone_device", refused)
    ops = Ops()
    session = fuse_session.FuseSession(ops, "/unused", fd=daemon.detach(), threads=2,  # type: ignore[arg-type]
                                       clones=[clone_daemon.detach()])

    async def main() -> None:
        serving = asyncio.create_task(session.serve(4))
        await initialised(kernel)
        await asyncio.to_thread(clone_kernel.send, request(wire.GETATTR, 2, wire.GETATTR_IN.pack(0, 0, 0), nodeid=7))
        assert await asyncio.to_thread(read_reply, clone_kernel) == (2, 0, struct.pack("<Q", 7))
        kernel.close()
        clone_kernel.close()
        await asyncio.wait_for(serving, WAIT_S)

    with asyncio.Runner(loop_factory=SharedLoop) as runner, caplog.at_level("INFO"):
        runner.run(main())
        session.close()
    assert session._threaded and ops.threads == ["fuse-reader-1"]
    assert "cannot clone" not in caplog.text and "2 threads read the mount's requests" in caplog.text


def test_the_handover_clones_with_the_protocol_ioctl() -> None:
    """cachefs.handover (a leaf module, used by the CSI node plugin) spells FUSE_DEV_IOC_CLONE itself."""
    from cachefs import handover

    assert handover.DEV_IOC_CLONE == wire.DEV_IOC_CLONE == 0x8004E500


def test_a_timer_set_by_a_reader_wakes_the_loop_only_if_due_before_the_loop_wakes_by_itself() -> None:
    """A read that waits for a load sets a deadline seconds away: it must not cost the loop a turn, and
    the loop must still see it when it wakes for its own earlier timer; a nearer timer wakes it."""
    created: list[tuple[SharedLoop, float]] = []

    def run() -> None:
        loop = SharedLoop()
        # The loop's own wake-up: far enough for the test to hold the state lock before it, on a
        # loaded machine too.
        own = loop.time() + 2.0
        loop.call_at(own, lambda: None)
        created.append((loop, own))
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: bool(created))
    loop, own = created[0]
    far, near = threading.Event(), threading.Event()
    with loop.holding_state():  # (granted while the loop waits for its timer)
        loop.call_at(own + 0.3, far.set)
        assert not loop.take_wake()  # due after the loop wakes by itself: no wake-up
        loop.call_at(loop.time() + 0.1, near.set)
        assert loop.take_wake()  # due before it: the loop must be woken to see it
    loop.wake()
    try:
        assert near.wait(WAIT_S)
        assert far.wait(WAIT_S)  # seen once the loop woke for its own timer
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
