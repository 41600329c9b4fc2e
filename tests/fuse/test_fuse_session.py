"""The FUSE session's two ways to mount (cachefs.fuse.session), on real mounts: mount(2) as root and
the setuid fusermount3 (what a non-root daemon uses; called directly here, as root, since this
machine's /dev/fuse may be closed to other users). Both show the bucket URL as the mount's source,
type fuse.cachefs and the mount flags, and the session's close removes what it mounted."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from pathlib import Path

import pytest

from cachefs import mounts
from cachefs.fuse import mounting
from cachefs.fuse import session as fuse_session
from cachefs.fuse import wire

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount(2) needs root")


def mount_line(target: Path) -> tuple[str, str, list[str]]:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == str(target):
            after = fields[fields.index("-") + 1:]
            return after[0], after[1], fields[5].split(",")
    raise AssertionError(f"{target} is not mounted")


def test_fusermount3_mounts_with_the_source_and_unmounts(tmp_path: Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()
    fd = mounting.fusermount(str(target), "s3://bucket/a,b", read_only=True, allow_other=False)
    try:
        fstype, source, options = mount_line(target)
        assert (fstype, source) == ("fuse.cachefs", "s3://bucket/a,b")  # the comma survived fusermount3's -o
        assert {"ro", "nosuid", "nodev"} <= set(options)
    finally:
        mounting.unmount(str(target), privileged=False)
        os.close(fd)
    assert mounts.find_mount(target) is None


def test_a_refused_fusermount3_names_its_reason(tmp_path: Path) -> None:
    with pytest.raises(mounting.MountError) as info:
        mounting.fusermount(str(tmp_path / "missing"), "s3://b", read_only=True, allow_other=False)
    assert "failed to access mountpoint" in (info.value.strerror or "")


class Ops:
    """No handlers: every request but INIT is answered ENOSYS."""

    inline: dict = {}
    handlers: dict = {}
    reader_inline: dict = {}

    def failure(self, opcode: int, exc: BaseException) -> int:
        return 5

    wanted_flags = 0

    def negotiated(self, flags: int, backing: object, notifier: object) -> None:
        self.flags = flags
        self.notifier = notifier


async def test_a_root_mount_negotiates_with_the_kernel_and_ends_at_unmount(tmp_path: Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()
    ops = Ops()
    session = fuse_session.FuseSession(ops, str(target), source="gs://bucket/p?token=secret", read_only=True)  # type: ignore[arg-type]
    session.mount()
    try:
        assert mount_line(target)[:2] == ("fuse.cachefs", "gs://bucket/p")
        serving = asyncio.create_task(session.serve(4))
        # The kernel asks for INIT on the first access; stat answers ENOSYS from this session.
        with pytest.raises(OSError):
            await asyncio.to_thread(os.stat, target)
        assert session.proto_minor == wire.KERNEL_MINOR and ops.flags & wire.ASYNC_READ
        assert ops.flags & ~fuse_session.WANTED_FLAGS == 0
        # The kernel takes our notifications: the root inode it holds (0), a name it never held (ENOENT;
        # a message it could not decode would be EINVAL).
        outcomes: list[tuple[int, int]] = []
        assert ops.notifier is not None
        ops.notifier.report = lambda code, error: outcomes.append((code, error))
        ops.notifier.forget_inode(1)
        ops.notifier.forget_entry(1, b"never-looked-up")
        deadline = time.monotonic() + 10
        while len(outcomes) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert outcomes == [(wire.NOTIFY_INVAL_INODE, 0), (wire.NOTIFY_INVAL_ENTRY, errno.ENOENT)]
        await asyncio.to_thread(mounting.unmount, str(target), privileged=True)
        await asyncio.wait_for(serving, 30)  # ENODEV: the mount is gone, serve returns
    finally:
        session.close()
    assert mounts.find_mount(target) is None
