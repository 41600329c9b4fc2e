"""Reply writers (``cachefs.fuse.replies``): large replies leave the loop whole, in any thread, and
none is lost or written after the session's end.

A SOCK_SEQPACKET socket stands in for /dev/fuse, as in test_fuse_adapter: each writev is one message.
"""

from __future__ import annotations

import errno
import os
import socket
import threading

import pytest

from cachefs.fuse import replies, session as fuse_session, wire
from cachefs.fuse.adapter import FuseOperations
from cachefs.fuse.replies import ReplyWriters
from tests.unit.test_fuse_adapter import fs, open_of, read_in, serving, store  # noqa: F401 - fixtures

WAIT_S = 10


def pair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.settimeout(WAIT_S)
    return ours, theirs


def test_a_submitted_reply_arrives_whole_from_a_writer_thread() -> None:
    ours, theirs = pair()
    writers = ReplyWriters(ours.fileno(), on_gone=lambda: None)
    try:
        payload = os.urandom(64 * 1024)
        assert writers.submit([wire.out_header(7, 0, len(payload)), memoryview(payload)])
        message = theirs.recv(1 << 20)
        assert message == wire.out_header(7, 0, len(payload)) + payload
        assert writers.offloaded == 1
    finally:
        assert writers.close()
        ours.close()
        theirs.close()


def test_close_writes_what_was_queued_then_refuses_more() -> None:
    ours, theirs = pair()
    gate = threading.Event()
    real_writev = os.writev

    def slow_writev(fd: int, buffers: list[bytes]) -> int:
        gate.wait(WAIT_S)
        return real_writev(fd, buffers)

    writers = ReplyWriters(ours.fileno(), on_gone=lambda: None, threads=1, max_queued=4)
    try:
        replies.os.writev = slow_writev  # type: ignore[attr-defined]
        sent = [wire.out_header(u, 0, 3) + b"abc" for u in range(1, 5)]
        assert all(writers.submit([m]) for m in sent)
        assert not writers.submit([b"fifth"])  # four wait: the caller writes this one itself
        gate.set()
        assert writers.close()
        assert not writers.submit([b"late"])  # closed: never written after the end
        got = [theirs.recv(4096) for _ in sent]
        assert sorted(got) == sorted(sent)
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(4096)
    finally:
        replies.os.writev = real_writev  # type: ignore[attr-defined]
        ours.close()
        theirs.close()


def test_a_gone_connection_is_reported_and_an_abandoned_request_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    failures = [errno.ENOENT, errno.ENODEV]

    def failing_writev(fd: int, buffers: list[bytes]) -> int:
        raise OSError(failures.pop(0), "refused")

    monkeypatch.setattr(replies.os, "writev", failing_writev)
    gone = threading.Event()
    writers = ReplyWriters(-1, on_gone=gone.set, threads=1)
    try:
        assert writers.submit([b"abandoned"])  # ENOENT: the kernel no longer wants it
        assert writers.submit([b"unmounted"])  # ENODEV: the session must end
        assert gone.wait(WAIT_S)
        assert failures == []
    finally:
        writers.close()


async def test_a_large_read_reply_is_written_by_a_writer_and_arrives_intact(
        fs, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811 - the fixture
    monkeypatch.setattr(fuse_session, "OFFLOAD_MIN_BYTES", 50)
    async for kernel, session in serving(FuseOperations(fs)):
        _, payload = await kernel.call(wire.LOOKUP, b"dir\0")
        d = int.from_bytes(payload[:8], "little")
        _, payload = await kernel.call(wire.LOOKUP, b"file.bin\0", nodeid=d)
        f = int.from_bytes(payload[:8], "little")
        fh, _ = open_of((await kernel.call(wire.OPEN, wire.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=f))[1])
        before = session.offloaded_replies
        assert await kernel.call(wire.READ, read_in(fh, 0, 10), nodeid=f, unique=2) == (0, b"0123456789")
        assert session.offloaded_replies == before  # below the threshold: written on the loop
        assert await kernel.call(wire.READ, read_in(fh, 0, 100), nodeid=f, unique=3) == (0, b"0123456789" * 10)
        assert session.offloaded_replies == before + 1
