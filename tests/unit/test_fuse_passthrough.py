"""The adapter's passthrough bookkeeping (cachefs.fuse.adapter.Passthrough) against the kernel's rules.

fs/fuse/iomode.c fails an open with EIO when an inode would be read both through a backing file and
through the daemon at once, or through two different backing files: these tests hold the adapter to
never asking for either, with a filesystem and a backing registrar that record what they are asked.
"""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import threading
from pathlib import Path

import pytest

import cachefs.fuse.session as session_module
from cachefs.backing import BrokerError
from cachefs.fs.stats import FsStats
from cachefs.fuse import wire
from cachefs.fuse.adapter import Passthrough
from cachefs.fuse.wire import FuseError
from tests.unit.test_fuse_adapter import serving


class Fs:
    """``backing_file`` answers from ``paths`` (fh -> whole file or None); releases are recorded."""

    def __init__(self) -> None:
        self.stats = FsStats()
        self.paths: dict[int, str | None] = {}
        self.released: list[int] = []
        self.abandoned: list[int] = []

    async def backing_file(self, fh: int, *, assemble: bool = True) -> str | None:
        return self.paths.get(fh)

    def release(self, fh: int) -> None:
        self.released.append(fh)

    def abandon_open(self, fh: int) -> None:
        self.abandoned.append(fh)


class Backing:
    def __init__(self, refuse: int = 0) -> None:
        self.refuse = refuse
        self.opened: list[str] = []
        self.closed: list[int] = []

    def open(self, path: str) -> int:
        if self.refuse:
            raise OSError(self.refuse, os.strerror(self.refuse))
        self.opened.append(path)
        return len(self.opened)

    def close(self, backing_id: int) -> None:
        self.closed.append(backing_id)


def setup(refuse: int = 0) -> tuple[Passthrough, Fs, Backing]:
    fs, backing = Fs(), Backing(refuse)
    return Passthrough(fs, backing), fs, backing  # type: ignore[arg-type]


async def test_opens_of_one_version_share_one_backing_file_kept_until_the_inode_is_forgotten() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/c/whole/ab/ab", 2: "/c/whole/ab/ab", 3: "/c/whole/ab/ab"}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    assert await pt.open(5, 2, os.O_RDONLY) == 1
    assert backing.opened == ["/c/whole/ab/ab"]  # one registration: the kernel refuses a second file (EBUSY)
    pt.release(1)
    pt.release(2)
    assert backing.closed == [] and list(pt.idle) == [5]  # kept for the next open of the inode
    assert await pt.open(5, 3, os.O_RDONLY) == 1  # registered once, whatever the number of opens
    assert backing.opened == ["/c/whole/ab/ab"] and list(pt.idle) == []
    pt.release(3)
    pt.forgotten(5)
    assert backing.closed == [1] and pt.held == {} and pt.by_path == {}
    assert fs.stats.passthrough_opens == 3
    assert fs.stats.backing_registrations == 1 and fs.stats.backing_ids == 0


async def test_a_forgotten_inode_with_open_files_keeps_its_id() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/w"}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    pt.forgotten(5)  # (the kernel forgets no inode with open files; a lookup that failed may send one)
    assert backing.closed == [] and pt.held[5].handles == 1
    pt.release(1)
    assert backing.closed == [] and list(pt.idle) == [5]


async def test_a_whole_file_removed_from_the_disk_tier_closes_its_id() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/w", 2: "/v", 3: "/w", 4: "/v"}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    assert await pt.open(6, 2, os.O_RDONLY) == 2
    pt.release(1)
    pt.dropped("/w")  # kept, no open uses it: closed at once (on the loop)
    pt.dropped("/v")  # an open uses it: the kernel holds the file; the id goes at the last release
    await asyncio.sleep(0)
    assert backing.closed == [1] and 5 not in pt.held and pt.held[6].dropped
    pt.release(2)
    assert backing.closed == [1, 2] and pt.held == {} and pt.idle == {}
    # The whole files are assembled again: the next opens register them anew.
    assert await pt.open(5, 3, os.O_RDONLY) == 3 and await pt.open(6, 4, os.O_RDONLY) == 4
    assert backing.opened == ["/w", "/v", "/w", "/v"] and fs.stats.backing_registrations == 4


async def test_a_removal_told_from_another_thread_is_taken_on_the_loop() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/w"}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    pt.release(1)
    thread = threading.Thread(target=pt.dropped, args=("/w",))
    thread.start()
    thread.join()
    assert backing.closed == []  # not from the evicting thread: the bookkeeping is the loop's
    deadline = asyncio.get_running_loop().time() + 5
    while backing.closed != [1]:
        assert asyncio.get_running_loop().time() < deadline, "the removal was never taken"
        await asyncio.sleep(0.001)
    assert pt.held == {}


async def test_a_kept_id_of_another_version_or_of_no_whole_file_is_closed_at_the_next_open() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/whole/old", 2: "/whole/new", 3: None}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    pt.release(1)
    assert await pt.open(5, 2, os.O_RDONLY) == 2  # the object changed in the bucket: no ETXTBSY, no old id
    assert backing.closed == [1] and pt.held[5].path == "/whole/new"
    pt.release(2)
    assert await pt.open(5, 3, os.O_RDONLY) is None  # not whole on disk: served by the daemon
    pt.ordinary_open(5, 3)
    assert backing.closed == [1, 2] and pt.held == {}
    assert fs.stats.passthrough_refused == 0 and fs.abandoned == []


async def test_kept_ids_are_bounded_the_least_recently_used_closed_first() -> None:
    fs, backing = Fs(), Backing()
    pt = Passthrough(fs, backing, idle_ids=2)  # type: ignore[arg-type]
    fs.paths = {fh: f"/w{fh}" for fh in range(1, 5)}
    for fh in range(1, 4):
        assert await pt.open(10 + fh, fh, os.O_RDONLY) == fh
    for fh in (2, 1, 3):
        pt.release(fh)
    assert backing.closed == [2] and list(pt.idle) == [11, 13]
    fs.paths[5] = "/w1"
    assert await pt.open(11, 5, os.O_RDONLY) == 1  # reused: it leaves the kept ones
    pt.release(5)
    assert list(pt.idle) == [13, 11] and backing.closed == [2]
    assert fs.stats.backing_ids == 2


async def test_an_inode_open_the_ordinary_way_is_not_passed_through_until_released() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: None, 2: "/w", 3: "/w"}
    assert await pt.open(5, 1, os.O_RDONLY) is None
    pt.ordinary_open(5, 1)
    assert await pt.open(5, 2, os.O_RDONLY) is None  # the kernel holds 5 in cached mode (ETXTBSY -> EIO)
    pt.ordinary_open(5, 2)
    pt.release(1)
    pt.release(2)
    assert await pt.open(5, 3, os.O_RDONLY) == 1
    assert backing.opened == ["/w"]


async def test_writable_and_truncating_opens_never_pass_through() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/w", 2: "/w"}
    assert await pt.open(5, 1, os.O_RDWR) is None
    assert await pt.open(6, 2, os.O_RDONLY | os.O_TRUNC) is None
    assert backing.opened == [] and fs.stats.passthrough_opens == 0


async def test_another_version_of_a_held_inode_is_refused_not_served_old_bytes() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/whole/old", 2: "/whole/new", 3: None}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    for fh in (2, 3):
        with pytest.raises(FuseError) as info:
            await pt.open(5, fh, os.O_RDONLY)
        assert info.value.errno == errno.ETXTBSY
    assert fs.abandoned == [2, 3] and fs.stats.passthrough_refused == 2
    pt.release(1)
    assert await pt.open(5, 4, os.O_RDONLY) is None  # fh 4 has no whole file: served by the daemon


async def test_opens_of_a_held_inode_still_join_it_after_registrations_were_refused() -> None:
    pt, fs, backing = setup()
    fs.paths = {1: "/w", 2: "/w", 3: "/v"}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    backing.refuse = errno.EPERM
    assert await pt.open(6, 3, os.O_RDONLY) is None and not pt.enabled
    assert await pt.open(5, 2, os.O_RDONLY) == 1  # the kernel holds 5 through /w: this open must pass too
    pt.release(1)
    pt.release(2)
    assert backing.closed == [1]  # closed even though no new registration is asked for


@pytest.mark.parametrize("code", [errno.EPERM, errno.ELOOP])
async def test_a_refused_registration_turns_passthrough_off_for_the_session(code: int) -> None:
    pt, fs, backing = setup(refuse=code)
    fs.stats.passthrough_active = True
    fs.paths = {1: "/w", 2: "/w"}
    assert await pt.open(5, 1, os.O_RDONLY) is None
    assert not pt.enabled and not fs.stats.passthrough_active and fs.stats.passthrough_fallbacks == 1
    assert await pt.open(6, 2, os.O_RDONLY) is None
    assert fs.stats.passthrough_fallbacks == 1  # not asked again


async def test_a_whole_file_gone_before_registration_is_served_by_the_daemon() -> None:
    pt, fs, backing = setup(refuse=errno.ENOENT)
    fs.paths = {1: "/w"}
    assert await pt.open(5, 1, os.O_RDONLY) is None
    assert pt.enabled and fs.stats.passthrough_fallbacks == 1


class WantingOps:
    """An adapter that asks for passthrough and records what INIT agreed."""

    inline: dict = {}
    handlers: dict = {}
    reader_inline: dict = {}
    wanted_flags = wire.PASSTHROUGH

    def failure(self, opcode: int, exc: BaseException) -> int:
        return errno.EIO

    def negotiated(self, flags: int, backing: object, notifier: object) -> None:
        self.flags, self.backing = flags, backing


def init_offering(flags: int) -> bytes:
    """fuse_init_in of 7.45 (flags2 and the unused words after the 16-byte start)."""
    return wire.INIT_IN.pack(7, 45, 128 * 1024, (flags | wire.INIT_EXT) & 0xFFFFFFFF) + struct.pack(
        "<I", flags >> 32) + bytes(44)


@pytest.mark.parametrize(("offered", "privileged", "agreed"), [
    (wire.PASSTHROUGH, True, True),
    (wire.PASSTHROUGH, False, False),  # the kernel would refuse every backing file: not asked
    (0, True, False),  # a kernel without it
])
async def test_init_agrees_to_passthrough_only_where_it_can_be_used(
        monkeypatch: pytest.MonkeyPatch, offered: int, privileged: bool, agreed: bool) -> None:
    monkeypatch.setattr(session_module, "may_register_backing", lambda: privileged)
    ops = WantingOps()
    async for kernel, _ in serving(ops):
        error, payload = await kernel.call(wire.INIT, init_offering(offered | wire.ASYNC_READ), nodeid=0)
        assert error == 0
        flags, = struct.unpack_from("<I", payload, 12)
        flags2, depth = struct.unpack_from("<II", payload, 32)
        assert bool(flags2 & 1 << 5) is agreed and bool(ops.flags & wire.PASSTHROUGH) is agreed
        assert bool(flags & wire.INIT_EXT) is agreed and depth == (1 if agreed else 0)
        assert (ops.backing is not None) is agreed


def test_may_register_backing_needs_cap_sys_admin_in_the_initial_user_namespace(tmp_path: Path) -> None:
    status = tmp_path / "status"
    initial = os.stat("/proc/self/ns/user").st_ino == 0xEFFFFFFD
    status.write_text("Name:\tx\nCapEff:\t000001ffffffffff\n")
    assert session_module.may_register_backing(str(status)) is initial
    status.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    assert session_module.may_register_backing(str(status)) is False
    assert session_module.may_register_backing(str(tmp_path / "missing")) is False


class ProbedBroker:
    """Stands in for ``BrokerBackingFiles``: its probe answers, or fails as a missing plugin does."""

    fail = False

    def __init__(self, path: Path, fuse_fd: int) -> None:
        self.path, self.fuse_fd = path, fuse_fd

    def probe(self) -> None:
        if self.fail:
            raise BrokerError(errno.ECONNREFUSED, f"cannot reach the node plugin's broker {self.path}")

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize(("broker", "answers", "agreed"), [
    (True, True, True),  # an unprivileged daemon whose node plugin registers for it
    (True, False, False),  # the plugin does not answer: not asked
    (False, True, False),  # no broker named
])
async def test_an_unprivileged_daemon_agrees_to_passthrough_when_its_broker_answers(
        monkeypatch: pytest.MonkeyPatch, broker: bool, answers: bool, agreed: bool) -> None:
    monkeypatch.setattr(session_module, "may_register_backing", lambda: False)
    monkeypatch.setattr(ProbedBroker, "fail", not answers)
    monkeypatch.setattr(session_module, "BrokerBackingFiles", ProbedBroker)
    ops = WantingOps()
    async for kernel, session in serving(ops):
        session.broker = Path("/run/x/backing.sock") if broker else None
        error, payload = await kernel.call(wire.INIT, init_offering(wire.PASSTHROUGH | wire.ASYNC_READ), nodeid=0)
        assert error == 0
        flags2, depth = struct.unpack_from("<II", payload, 32)
        assert bool(flags2 & 1 << 5) is agreed and depth == (1 if agreed else 0)
        assert isinstance(ops.backing, ProbedBroker) is agreed
        if agreed:
            assert ops.backing.fuse_fd == session.fd  # the connection's own descriptor goes with each request


class BrokenBroker(Backing):
    def open(self, path: str) -> int:
        raise BrokerError(errno.EPIPE, "the node plugin's broker /r/backing.sock did not answer within 2 s")

    def close(self, backing_id: int) -> None:
        raise BrokerError(errno.EPIPE, "the node plugin's broker /r/backing.sock did not answer within 2 s")


async def test_a_broker_that_fails_turns_passthrough_off_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    fs, backing = Fs(), Backing()
    pt = Passthrough(fs, backing)  # type: ignore[arg-type]
    fs.paths = {1: "/w", 2: "/v"}
    assert await pt.open(5, 1, os.O_RDONLY) == 1
    pt.backing = BrokenBroker()  # type: ignore[assignment]
    with caplog.at_level("WARNING", logger="cachefs.fuse.adapter"):
        pt.release(1)
        pt.forgotten(5)  # the close is the first call to find it stuck
        assert not pt.enabled and not fs.stats.passthrough_active
        assert await pt.open(6, 2, os.O_RDONLY) is None  # not asked again
    assert [r.getMessage() for r in caplog.records] == [
        "passthrough: the node plugin's broker /r/backing.sock did not answer within 2 s; the daemon serves every "
        "read from now on"]
    fs2 = Fs()
    pt2 = Passthrough(fs2, BrokenBroker())  # type: ignore[arg-type]
    fs2.paths = {1: "/w"}
    assert await pt2.open(5, 1, os.O_RDONLY) is None and not pt2.enabled and fs2.stats.passthrough_fallbacks == 1
