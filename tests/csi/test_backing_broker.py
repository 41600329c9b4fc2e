"""The passthrough broker's checks (csi_driver.backing), each refusal on real descriptors and a real socket.

The broker runs with the node plugin's privileges and the kernel keeps the plugin's credentials for
every backing file it registers, so each way a compromised daemon could try to have it register
something else is refused here: a descriptor that is not /dev/fuse, a backing file opened for writing
or with O_PATH, one outside the volume's cache directory (directly, through a symlink, or renamed
away), a hard link, another owner's file, a peer of another uid, more ids than the bound, and closing
an id this mount's broker did not register. The ioctls themselves are passed in (a recorder) where
the test is about the bookkeeping; the real ones run in tests/csi/test_backing_passthrough.py.
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

from cachefs.backing import OP_CLOSE, OP_OPEN, OP_PING, BrokerBackingFiles, BrokerError
from csi_driver.backing import BackingBroker, Refused, check_backing_fd, check_fuse_fd

DAEMON_UID = 4242  # no passwd entry needed: only numbers are compared


class Ioctls:
    """Stands in for the two ioctls of one connection: records them, hands out ids, and refuses a close
    of an id the connection does not hold with ENOENT, as fs/fuse/backing.c does."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.closed: list[int] = []

    def register(self, fuse_fd: int, file_fd: int) -> int:
        self.registered.append((fuse_fd, file_fd))
        return len(self.registered)

    def unregister(self, fuse_fd: int, backing_id: int) -> None:
        if not 0 < backing_id <= len(self.registered) or backing_id in self.closed:
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT))
        self.closed.append(backing_id)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bb-", dir="/tmp"))  # short: a unix socket lives here
    try:
        yield path
    finally:
        for root, dirs, files in os.walk(path, topdown=False):
            for name in files:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                os.rmdir(os.path.join(root, name))
        os.rmdir(path)


@pytest.fixture
def cache(base: Path) -> Path:
    path = base / "cache" / "slot-0"
    (path / "whole" / "ab").mkdir(parents=True)
    return path


@pytest.fixture
def fuse_fd() -> Iterator[int]:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        pytest.skip(f"/dev/fuse cannot be opened here: {exc.strerror}")
    try:
        yield fd
    finally:
        os.close(fd)


def daemon_file(path: Path, data: bytes = b"whole file\n", uid: int = DAEMON_UID) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chown(path, uid, uid)
    return path


def refusal(fd: int, cache: Path) -> tuple[int, str]:
    with pytest.raises(Refused) as info:
        check_backing_fd(fd, DAEMON_UID, os.path.realpath(cache))
    return info.value.code, info.value.reason


def opened(path: Path, flags: int = os.O_RDONLY) -> int:
    return os.open(path, flags | os.O_CLOEXEC)


def test_a_read_only_cache_file_of_the_daemon_is_accepted(cache: Path) -> None:
    path = daemon_file(cache / "whole" / "ab" / "abcd")
    fd = opened(path)
    try:
        assert check_backing_fd(fd, DAEMON_UID, os.path.realpath(cache)) == str(path)
    finally:
        os.close(fd)


def test_only_dev_fuse_is_taken_as_the_mounts_descriptor(cache: Path, fuse_fd: int) -> None:
    check_fuse_fd(fuse_fd)
    for path in ("/dev/null", str(daemon_file(cache / "x"))):  # another character device; a regular file
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            with pytest.raises(Refused) as info:
                check_fuse_fd(fd)
            assert info.value.code == errno.EBADF and "not /dev/fuse" in info.value.reason
        finally:
            os.close(fd)


def test_a_backing_file_opened_for_writing_or_with_o_path_is_refused(cache: Path) -> None:
    path = daemon_file(cache / "whole" / "ab" / "abcd")
    for flags, code, words in ((os.O_RDWR, errno.EACCES, "not opened read-only"),
                               (os.O_WRONLY, errno.EACCES, "not opened read-only"),
                               (os.O_PATH, errno.EBADF, "O_PATH")):
        fd = opened(path, flags)
        try:
            got, reason = refusal(fd, cache)
            assert got == code and words in reason, reason
        finally:
            os.close(fd)


def test_a_directory_or_another_owners_file_is_refused(cache: Path) -> None:
    fd = opened(cache / "whole")
    try:
        assert refusal(fd, cache)[0] == errno.EINVAL
    finally:
        os.close(fd)
    fd = opened(daemon_file(cache / "whole" / "ab" / "roots", uid=0))
    try:
        code, reason = refusal(fd, cache)
        assert code == errno.EACCES and "owned by uid 0" in reason
    finally:
        os.close(fd)


def test_a_file_outside_the_cache_directory_is_refused(base: Path, cache: Path) -> None:
    outside = daemon_file(base / "elsewhere" / "secret")
    sibling = daemon_file(base / "cache" / "slot-00" / "f")  # a prefix of the name is not "under"
    for path in (outside, sibling):
        fd = opened(path)
        try:
            code, reason = refusal(fd, cache)
            assert code == errno.EACCES and "outside the volume's cache directory" in reason, reason
        finally:
            os.close(fd)


def test_a_symlink_in_the_cache_directory_to_a_file_outside_is_refused(base: Path, cache: Path) -> None:
    outside = daemon_file(base / "elsewhere" / "secret")
    link = cache / "whole" / "ab" / "link"
    link.symlink_to(outside)
    fd = opened(link)  # the daemon opens through the link: the descriptor is the file outside
    try:
        code, reason = refusal(fd, cache)
        assert code == errno.EACCES and str(outside) in reason
    finally:
        os.close(fd)


def test_a_file_renamed_away_and_replaced_is_refused(base: Path, cache: Path) -> None:
    path = daemon_file(cache / "whole" / "ab" / "abcd")
    fd = opened(path)
    try:
        (base / "elsewhere").mkdir()
        os.rename(path, base / "elsewhere" / "abcd")
        assert refusal(fd, cache)[0] == errno.EACCES  # its path is outside now
        # The same file moved back under another name, and a different file put at its old name.
        os.rename(base / "elsewhere" / "abcd", cache / "whole" / "ab" / "moved")
        daemon_file(path, b"another file\n")
        assert check_backing_fd(fd, DAEMON_UID, os.path.realpath(cache)).endswith("/moved")
    finally:
        os.close(fd)


def test_a_path_that_names_another_file_is_refused(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path the kernel gives is the one the daemon's mount namespace sees (a mount pod's): where
    the plugin finds another file under that name, the descriptor is refused, not the name trusted."""
    sent = daemon_file(cache / "whole" / "ab" / "sent")
    other = daemon_file(cache / "whole" / "ab" / "other")
    fd = opened(sent)
    real_readlink = os.readlink
    monkeypatch.setattr(os, "readlink", lambda p: str(other) if p == f"/proc/self/fd/{fd}" else real_readlink(p))
    try:
        code, reason = refusal(fd, cache)
        assert code == errno.EACCES and "names another file" in reason
    finally:
        os.close(fd)


def test_a_hard_link_is_refused(base: Path, cache: Path) -> None:
    target = daemon_file(base / "elsewhere" / "secret")
    link = cache / "whole" / "ab" / "hard"
    os.link(target, link)
    fd = opened(link)
    try:
        code, reason = refusal(fd, cache)
        assert code == errno.EMLINK and "2 links" in reason
    finally:
        os.close(fd)


def test_a_deleted_file_is_refused(cache: Path) -> None:
    path = daemon_file(cache / "whole" / "ab" / "gone")
    fd = opened(path)
    try:
        path.unlink()
        assert refusal(fd, cache)[0] in (errno.EMLINK, errno.EACCES)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- through the broker's socket
@pytest.fixture
def broker(base: Path, cache: Path) -> Iterator[tuple[BackingBroker, Ioctls]]:
    ioctls = Ioctls()
    run_dir = base / "run"
    run_dir.mkdir()
    broker = BackingBroker(run_dir / "backing.sock", uid=os.geteuid(), gid=None, cache_dir=cache, max_ids=3,
                           register=ioctls.register, unregister=ioctls.unregister)
    broker.start()
    try:
        yield broker, ioctls
    finally:
        broker.stop()


def own_file(cache: Path, name: str) -> str:
    return str(daemon_file(cache / "whole" / "ab" / name, uid=os.geteuid()))


def test_the_socket_is_the_daemons_alone(broker: tuple[BackingBroker, Ioctls]) -> None:
    st = os.stat(broker[0].path)
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, os.geteuid())


def test_registrations_are_bounded_and_only_this_brokers_ids_are_closed(
        broker: tuple[BackingBroker, Ioctls], cache: Path, fuse_fd: int) -> None:
    server, ioctls = broker
    client = BrokerBackingFiles(server.path, fuse_fd)
    try:
        client.probe()
        ids = [client.open(own_file(cache, f"f{i}")) for i in range(3)]
        assert ids == [1, 2, 3] and server.ids == {1, 2, 3}
        with pytest.raises(OSError) as info:  # the bound: this open only, served by the daemon
            client.open(own_file(cache, "f3"))
        assert info.value.errno == errno.ENFILE and not isinstance(info.value, BrokerError)
        assert len(ioctls.registered) == 3
        client.close(2)
        assert ioctls.closed == [2] and server.ids == {1, 3}
        assert client.open(own_file(cache, "f4")) == 4  # room again
        with pytest.raises(OSError) as info:  # never registered here: never handed to the kernel
            client.close(99)
        assert info.value.errno == errno.ENOENT and ioctls.closed == [2]
        client.probe()  # still usable
    finally:
        client.shutdown()
    server.stop()
    assert server.ids == set() and not server.path.exists()  # forgotten with the mount


def test_a_refusal_ends_passthrough_for_the_session(broker: tuple[BackingBroker, Ioctls], base: Path,
                                                    fuse_fd: int) -> None:
    server, ioctls = broker
    client = BrokerBackingFiles(server.path, fuse_fd)
    try:
        outside = base / "elsewhere"
        outside.mkdir()
        (outside / "secret").write_bytes(b"x")
        with pytest.raises(BrokerError) as info:
            client.open(str(outside / "secret"))
        assert info.value.errno == errno.EACCES and "refused" in info.value.strerror
        assert ioctls.registered == []
        with pytest.raises(BrokerError):  # not asked again
            client.probe()
    finally:
        client.shutdown()


def test_a_descriptor_that_is_not_dev_fuse_is_never_given_to_ioctl(broker: tuple[BackingBroker, Ioctls],
                                                                   cache: Path) -> None:
    server, ioctls = broker
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    try:
        for op, arg, fds in ((OP_OPEN, 0, [null, null]), (OP_CLOSE, 1, [null]), (OP_PING, 0, [null])):
            assert server.handle(op, arg, fds) == -errno.EBADF
        assert server.handle(b"XXXX", 0, [null]) == -errno.EINVAL
        assert server.handle(OP_OPEN, 0, [null]) == -errno.EINVAL  # one descriptor short
    finally:
        os.close(null)
    assert ioctls.registered == [] and ioctls.closed == []
    client = BrokerBackingFiles(server.path, os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC))
    try:
        with pytest.raises(BrokerError) as info:
            client.probe()
        assert info.value.errno == errno.EBADF
    finally:
        client.shutdown()
        os.close(client.fuse_fd)


def test_a_peer_of_another_uid_is_refused(base: Path, cache: Path, fuse_fd: int) -> None:
    ioctls = Ioctls()
    run_dir = base / "run"
    run_dir.mkdir()
    server = BackingBroker(run_dir / "backing.sock", uid=DAEMON_UID, gid=DAEMON_UID, cache_dir=cache,
                           register=ioctls.register, unregister=ioctls.unregister)
    server.start()
    try:
        assert os.stat(server.path).st_uid == DAEMON_UID
        client = BrokerBackingFiles(server.path, fuse_fd)  # this test runs as root, not DAEMON_UID
        with pytest.raises(BrokerError) as info:
            client.probe()
        assert info.value.errno == errno.EPERM
        client.shutdown()
        assert ioctls.registered == []
    finally:
        server.stop()


def test_the_received_descriptors_are_closed(broker: tuple[BackingBroker, Ioctls], cache: Path,
                                            fuse_fd: int) -> None:
    server, _ = broker
    client = BrokerBackingFiles(server.path, fuse_fd)
    before = set(os.listdir("/proc/self/fd"))
    try:
        for i in range(3):
            client.open(own_file(cache, f"g{i}"))
        client.probe()
    finally:
        client.shutdown()
    deadline = time.monotonic() + 10
    while server._conns:  # the broker drops the connection the daemon closed (its thread sees the end)
        assert time.monotonic() < deadline, "the broker kept a closed connection"
        time.sleep(0.01)
    assert set(os.listdir("/proc/self/fd")) <= before  # the broker kept no copy of either descriptor


def test_a_stuck_broker_ends_passthrough_after_a_bounded_wait(base: Path, fuse_fd: int) -> None:
    path = base / "stuck.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)  # accepts (in the kernel's backlog) and never answers
    try:
        client = BrokerBackingFiles(path, fuse_fd, timeout_s=0.3)
        with pytest.raises(BrokerError) as info:
            client.probe()
        assert "did not answer within 0.3 s" in info.value.strerror
        with pytest.raises(BrokerError):
            client.close(1)  # at once: no second wait
        client.shutdown()
    finally:
        listener.close()


def test_a_restarted_broker_is_reached_again(base: Path, cache: Path, fuse_fd: int) -> None:
    run_dir = base / "run"
    run_dir.mkdir()
    first = BackingBroker(run_dir / "backing.sock", uid=os.geteuid(), gid=None, cache_dir=cache,
                          register=Ioctls().register, unregister=Ioctls().unregister)
    first.start()
    client = BrokerBackingFiles(first.path, fuse_fd)
    try:
        client.probe()
        first.stop()
        second = BackingBroker(run_dir / "backing.sock", uid=os.geteuid(), gid=None, cache_dir=cache,
                               register=Ioctls().register, unregister=Ioctls().unregister)
        second.start()
        try:
            assert client.open(own_file(cache, "h")) == 1
        finally:
            second.stop()
    finally:
        client.shutdown()


def test_a_broker_resumed_after_a_plugin_restart_closes_the_ids_the_earlier_one_registered(
        base: Path, cache: Path, fuse_fd: int) -> None:
    run_dir = base / "run"
    run_dir.mkdir()
    kernel = Ioctls()  # one connection: its ids outlive the plugin that registered them
    first = BackingBroker(run_dir / "backing.sock", uid=os.geteuid(), gid=None, cache_dir=cache,
                          register=kernel.register, unregister=kernel.unregister)
    first.start()
    client = BrokerBackingFiles(first.path, fuse_fd)
    try:
        kept = client.open(own_file(cache, "k"))  # the daemon keeps it between opens of the file
        first.stop()  # the plugin restarts; the daemon and its connection live on
        fresh = BackingBroker(run_dir / "backing.sock", uid=os.geteuid(), gid=None, cache_dir=cache,
                              register=kernel.register, unregister=kernel.unregister)
        fresh.start()
        try:  # a broker that never ran before for this mount closes only its own ids
            with pytest.raises(OSError) as info:
                client.close(kept)
            assert info.value.errno == errno.ENOENT and kernel.closed == []
        finally:
            fresh.stop()
        resumed = BackingBroker(run_dir / "backing.sock", uid=os.geteuid(), gid=None, cache_dir=cache,
                                resumed=True, register=kernel.register, unregister=kernel.unregister)
        resumed.start()
        try:
            client.close(kept)  # the earlier plugin's id: closed, its whole file let go
            assert kernel.closed == [kept]
            assert client.open(own_file(cache, "n")) == kept + 1  # and registrations go on
            client.close(kept + 1)
            assert kernel.closed == [kept, kept + 1] and resumed.ids == set()
            with pytest.raises(OSError) as info:  # an id the connection does not hold: the kernel's ENOENT
                client.close(kept)
            assert info.value.errno == errno.ENOENT and kernel.closed == [kept, kept + 1]
            client.probe()  # still usable
        finally:
            resumed.stop()
    finally:
        client.shutdown()


def test_no_broker_listening_is_said_in_one_line(base: Path, fuse_fd: int) -> None:
    client = BrokerBackingFiles(base / "missing.sock", fuse_fd)
    with pytest.raises(BrokerError) as info:
        client.probe()
    assert info.value.strerror.startswith("cannot reach the node plugin's broker")
