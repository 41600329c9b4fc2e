"""Write-back through a real mount on SeaweedFS: what a user does, checked in the bucket with boto3.

Files of several sizes (one above the 16 MiB multipart threshold) read back at once and land in the
bucket byte for byte after ``cachefs flush``; rename, unlink, mkdir/rmdir, truncate and append show
at once and end up in the bucket as the same tree; ``cachefs status`` names the durability stages;
``flush`` and ``unmount`` report what they cannot upload while the server is down, and succeed when
it is back; staged data survives kill -9 and ``unmount --force`` and is uploaded by the next mount;
``--write-through`` uploads before close returns and reports a failed upload to close.

The heavy campaigns (random operation model, fio, 20 crash trials, back-pressure) are in the
``test_writeback_*.py`` files next to this one.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.fuse.conftest import run_cli
from tests.support.s3servers import SeaweedS3

KiB, MiB = 1024, 1024 * 1024
PREFIX = "wb/"
# Uploads of a few MiB to a loopback SeaweedFS take well under a second; this is for a loaded runner.
FLUSH_S = 120


def s3env(server) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


def payload(seed: str, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def bucket_tree(server, bucket: str) -> tuple[dict[str, bytes], set[str]]:
    """Objects under PREFIX (relative key -> bytes) and directory markers (relative paths)."""
    client = server.client()
    files: dict[str, bytes] = {}
    markers: set[str] = set()
    token = None
    while True:
        kwargs = {"Bucket": bucket, "Prefix": PREFIX, **({"ContinuationToken": token} if token else {})}
        page = client.list_objects_v2(**kwargs)
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(PREFIX):]
            if rel.endswith("/"):
                markers.add(rel[:-1])
            elif rel:
                files[rel] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
        if not page.get("IsTruncated"):
            return files, markers
        token = page["NextContinuationToken"]


def flush(m, timeout: float = FLUSH_S):
    return run_cli("flush", str(m.path), "--timeout", f"{timeout:g}", env=m.env, timeout=timeout + 60)


def flush_ok(m) -> None:
    result = flush(m)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def bucket(seaweed) -> str:
    name = f"wb-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(name)
    return name


def test_files_of_every_size_read_back_at_once_and_land_in_the_bucket(seaweed, bucket: str, mounter) -> None:
    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", env=s3env(seaweed))
    files = {
        "empty": b"",
        "one": b"1",
        "small.txt": payload("small", 100 * KiB),
        "nested/deeper/mid.bin": payload("mid", 3 * MiB + 17),
        "big.bin": payload("big", 40 * MiB + 5),  # above the multipart threshold (16 MiB parts)
    }
    (m.path / "nested" / "deeper").mkdir(parents=True)
    for name, data in files.items():
        (m.path / name).write_bytes(data)
        assert (m.path / name).read_bytes() == data  # before any upload, from staging
        assert os.stat(m.path / name).st_size == len(data)
    flush_ok(m)
    got, markers = bucket_tree(seaweed, bucket)
    assert got == files
    assert markers <= {"nested", "nested/deeper"}
    head = seaweed.client().head_object(Bucket=bucket, Key=PREFIX + "big.bin")
    assert head["ETag"].strip('"').endswith("-3"), "40 MiB must go up as a 3-part multipart upload"
    for name, data in files.items():  # after the upload: the store's version, same bytes
        assert (m.path / name).read_bytes() == data
    stats = m.stats()
    assert stats["writeback"]["dirty_files"] == 0 and stats["writeback"]["files_uploaded"] == len(files)
    assert stats["object_store"]["bytes_written"] >= sum(map(len, files.values()))


def test_namespace_changes_show_at_once_and_end_up_in_the_bucket(seaweed, bucket: str, mounter) -> None:
    seaweed.put(bucket, PREFIX + "old/a.txt", b"a" * 1000)
    seaweed.put(bucket, PREFIX + "old/sub/b.txt", b"b" * 10)
    seaweed.put(bucket, PREFIX + "keep.txt", b"keep")
    seaweed.put(bucket, PREFIX + "gone.txt", b"gone")
    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", "--block-size", "256KiB", env=s3env(seaweed))
    root = m.path
    # append to an object in the store, truncate another, overwrite a third
    with open(root / "keep.txt", "ab") as fh:
        fh.write(b"+more")
    os.truncate(root / "old" / "a.txt", 10)
    (root / "gone.txt").unlink()
    # a write-then-rename save, over an existing name
    (root / "keep.txt.tmp").write_bytes(b"replaced")
    os.rename(root / "keep.txt.tmp", root / "replaced.txt")
    # directories: make, fill, rename, remove
    (root / "made" / "inner").mkdir(parents=True)
    (root / "made" / "inner" / "f").write_bytes(b"f")
    os.rename(root / "old", root / "renamed")
    (root / "empty").mkdir()
    (root / "doomed").mkdir()
    (root / "doomed" / "x").write_bytes(b"x")
    (root / "doomed" / "x").unlink()
    (root / "doomed").rmdir()
    with pytest.raises(OSError) as info:
        (root / "made").rmdir()
    assert info.value.errno == errno.ENOTEMPTY
    # random writes into a staged file
    with open(root / "made" / "inner" / "f", "r+b") as fh:
        fh.seek(5)
        fh.write(b"Z")
    expected = {
        "keep.txt": b"keep+more",
        "replaced.txt": b"replaced",
        "renamed/a.txt": b"a" * 10,
        "renamed/sub/b.txt": b"b" * 10,
        "made/inner/f": b"f\0\0\0\0Z",
    }
    seen = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            seen[str(path.relative_to(root))] = path.read_bytes()
    assert seen == expected
    assert sorted(os.listdir(root)) == ["empty", "keep.txt", "made", "renamed", "replaced.txt"]
    flush_ok(m)
    files, markers = bucket_tree(seaweed, bucket)
    assert files == expected
    assert "empty" in markers and not {"old", "doomed"} & markers
    # A fresh mount (nothing cached) sees the same tree.
    assert m.unmount().returncode == 0
    m2 = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", env=s3env(seaweed))
    assert sorted(os.listdir(m2.path)) == ["empty", "keep.txt", "made", "renamed", "replaced.txt"]
    assert (m2.path / "renamed" / "sub" / "b.txt").read_bytes() == b"b" * 10


def test_open_files_keep_their_content_when_unlinked_or_replaced(seaweed, bucket: str, mounter) -> None:
    """POSIX: a descriptor keeps the file it opened, whatever happens to its name. Each file spans
    several blocks, none read before its name goes, and with --upload-delay 0 the DELETE or the new
    object is in the bucket before the descriptor reads (or writes): the content had to be kept first."""
    size = 3 * 64 * KiB + 5
    names = ("read-unlinked", "read-replaced", "write-replaced", "incoming")
    data = {name: payload(name, size) for name in names}
    for name in names:
        seaweed.put(bucket, PREFIX + name, data[name])
    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", "--block-size", "64KiB", "--upload-delay", "0",
                      env=s3env(seaweed))
    root = m.path
    unlinked = os.open(root / "read-unlinked", os.O_RDONLY)
    replaced = os.open(root / "read-replaced", os.O_RDONLY)
    writer = os.open(root / "write-replaced", os.O_RDWR)
    try:
        os.unlink(root / "read-unlinked")
        (root / "new").write_bytes(b"new content")
        os.rename(root / "new", root / "read-replaced")  # a staged file over it
        os.rename(root / "incoming", root / "write-replaced")  # a server-side copy over it
        flush_ok(m)
        assert os.pread(unlinked, size + 10, 0) == data["read-unlinked"]
        assert os.pread(replaced, size + 10, 0) == data["read-replaced"]
        assert os.pwrite(writer, b"NEW", 3) == 3
        assert os.pread(writer, size + 10, 0) == data["write-replaced"][:3] + b"NEW" + data["write-replaced"][6:]
    finally:
        for fd in (unlinked, replaced, writer):
            os.close(fd)
    assert (root / "read-replaced").read_bytes() == b"new content"
    assert (root / "write-replaced").read_bytes() == data["incoming"]
    flush_ok(m)
    files, _ = bucket_tree(seaweed, bucket)
    assert files == {"read-replaced": b"new content", "write-replaced": data["incoming"]}


# The race below needs an open to land between the rename's look at A's open handles and the object's
# replacement: a few milliseconds per rename. It is looped until the daemon has seen opens inside that
# window (``opens_waited`` + ``stale_opens``) this many times, or a wrong read, or the deadline.
RACE_COVERED = 5
RACE_DEADLINE_S = 90.0


def test_descriptors_opened_while_a_file_is_replaced_read_one_version_whole(seaweed, bucket: str, mounter) -> None:
    """One writer saves A by writing a new file and renaming it over A, in a loop, with uploads at once
    (each replaced version has just been uploaded); four readers open A, wait a little, and read it.
    Every read returns one version whole, never ESTALE: an open that lands while a rename replaces A
    waits for it (issue 38, finding 4: 13 ESTALE in 6,660 such reads before)."""
    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", "--upload-delay", "0", env=s3env(seaweed))
    root = m.path

    def version(n: int) -> bytes:
        return b"v%06d;" % n * 400  # 3,200 bytes: one block, one upload

    (root / "A").write_bytes(version(0))
    stop = threading.Event()
    failures: list[str] = []
    reads = [0]

    def writer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            (root / f"t{n}").write_bytes(version(n))
            os.rename(root / f"t{n}", root / "A")

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                fd = os.open(root / "A", os.O_RDONLY)
            except OSError as exc:
                failures.append(f"open: {exc}")
                continue
            try:
                time.sleep(rng.uniform(0, 0.05))
                data = os.pread(fd, 10_000, 0)
                if len(data) != len(version(0)) or data != data[:8] * 400:
                    failures.append(f"read {len(data)} bytes, not one version whole: {data[:20]!r}")
                reads[0] += 1
            except OSError as exc:
                failures.append(f"read: {exc}")
            finally:
                os.close(fd)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + RACE_DEADLINE_S
    covered = 0
    try:
        while time.monotonic() < deadline and not failures and covered < RACE_COVERED:
            time.sleep(1)
            fs = m.stats()["filesystem"]
            covered = fs.get("opens_waited", 0) + fs.get("stale_opens", 0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert not failures, f"{len(failures)} failures in {reads[0]} reads: {failures[:3]}"
    assert covered >= RACE_COVERED, f"only {covered} opens raced with a rename in {RACE_DEADLINE_S:g} s"


# The second race below: a rename (or another writer's) landing between the lookup of the kernel's retry
# and its OPEN. Looped until the daemon served that many retried opens the file their lookup found
# (``retried_opens_kept``), or a failure, or the deadline.
RETRY_COVERED = 3


def test_opens_of_a_name_replaced_in_a_tight_loop_never_answer_estale(seaweed, bucket: str, mounter) -> None:
    """Two writers replace A by rename as fast as they can; eight readers open A and read it at once.
    The kernel answers an open of a file replaced after it resolved the name by looking the name up
    again and retrying once; the retry must not fail too when the next rename lands before its OPEN:
    open(2) of A, which always exists, never answers ESTALE, and each descriptor reads one version
    whole (issue 38, finding 4: 4,237 ESTALE in 144,155 opens of this loop in 60 s before)."""
    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", "--upload-delay", "0", env=s3env(seaweed))
    root = m.path

    def version(n: int) -> bytes:
        return b"v%06d;" % n * 400

    (root / "A").write_bytes(version(0))
    stop = threading.Event()
    failures: list[str] = []
    opens = [0]

    def writer(w: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            (root / f"t{w}-{n}").write_bytes(version(n))
            os.rename(root / f"t{w}-{n}", root / "A")

    def reader() -> None:
        while not stop.is_set():
            try:
                fd = os.open(root / "A", os.O_RDONLY)
            except OSError as exc:
                failures.append(f"open: {exc}")
                continue
            try:
                data = os.pread(fd, 10_000, 0)
                if len(data) != len(version(0)) or data != data[:8] * 400:
                    failures.append(f"read {len(data)} bytes, not one version whole: {data[:20]!r}")
                opens[0] += 1
            except OSError as exc:
                failures.append(f"read: {exc}")
            finally:
                os.close(fd)

    threads = ([threading.Thread(target=writer, args=(w,)) for w in range(2)]
               + [threading.Thread(target=reader) for _ in range(8)])
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + RACE_DEADLINE_S
    fs: dict = {}
    try:
        while time.monotonic() < deadline and not failures and fs.get("retried_opens_kept", 0) < RETRY_COVERED:
            time.sleep(1)
            fs = m.stats()["filesystem"]
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert not failures, f"{len(failures)} failures in {opens[0]} opens: {failures[:3]}"
    assert fs["retried_opens_kept"] >= RETRY_COVERED, (
        f"only {fs['retried_opens_kept']} retried opens raced with a rename in {RACE_DEADLINE_S:g} s "
        f"({fs['stale_opens']} opens answered ESTALE and retried)")
    assert fs["retried_opens_stale"] == 0


def test_status_names_the_durability_stage(seaweed, bucket: str, mounter) -> None:
    seaweed.put(bucket, PREFIX + "clean.txt", b"clean")
    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", "--upload-delay", "600", env=s3env(seaweed))
    (m.path / "dirty.bin").write_bytes(b"d" * 5000)
    result = run_cli("status", str(m.path / "dirty.bin"), str(m.path / "clean.txt"), str(m.path), env=m.env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[0] == "dirty" and "dirty.bin" in lines[0]
    assert lines[1].split()[0] == "clean" and "clean.txt" in lines[1]
    assert lines[2].split()[0] == "dirty"  # the mount root: something below it is pending
    doc = json.loads(run_cli("status", "--json", str(m.path / "dirty.bin"), env=m.env).stdout)
    assert doc[0]["stage"] == "dirty" and doc[0]["size"] == 5000
    missing = run_cli("status", str(m.path / "nope"), env=m.env)
    assert missing.returncode == 1 and "nope" in missing.stderr
    flush_ok(m)  # flush does not wait for the upload delay
    after = run_cli("status", str(m.path / "dirty.bin"), env=m.env)
    assert after.stdout.split()[0] == "clean"


def test_outage_flush_reports_unmount_refuses_force_and_the_next_mount_uploads(mounter, tmp_path: Path) -> None:
    with SeaweedS3() as server:
        bucket = f"wbo-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        env = s3env(server)
        cache = tmp_path / "shared-cache"
        source = f"s3://{bucket}/{PREFIX.rstrip('/')}"
        m = mounter.mount(source, "--connect-timeout", "1", "--read-timeout", "2", env=env, cache_dir=cache)
        (m.path / "before.txt").write_bytes(b"before")
        flush_ok(m)
        server.stop_keep_data()
        try:
            started = time.monotonic()
            (m.path / "during.bin").write_bytes(payload("during", 2 * MiB))
            with open(m.path / "during.bin", "ab") as fh:
                fh.write(b"+tail")
            (m.path / "dir").mkdir()
            (m.path / "dir" / "in.txt").write_bytes(b"in")
            (m.path / "before.txt").unlink()
            assert time.monotonic() - started < 20, "writes must not wait for a store that is down"
            assert (m.path / "during.bin").read_bytes() == payload("during", 2 * MiB) + b"+tail"

            result = flush(m, 3)
            assert result.returncode == 1
            for name in ("during.bin", "dir/in.txt", "before.txt"):
                assert name in result.stdout, result.stdout
            assert m.stats()["writeback"]["store_state"] == "unreachable"

            refused = run_cli("unmount", str(m.path), "--flush-timeout", "2", env=env)
            assert refused.returncode == 1 and m.mounted
            assert "--force" in refused.stderr and "during.bin" in refused.stderr
            forced = run_cli("unmount", str(m.path), "--force", env=env)
            assert forced.returncode == 0, forced.stderr
            assert not m.mounted
        finally:
            server.start()
        m2 = mounter.mount(source, env=env, cache_dir=cache, mountpoint=m.path)
        assert (m2.path / "during.bin").read_bytes() == payload("during", 2 * MiB) + b"+tail"
        flush_ok(m2)
        files, _markers = bucket_tree(server, bucket)
        assert files == {"during.bin": payload("during", 2 * MiB) + b"+tail", "dir/in.txt": b"in"}


def test_acknowledged_data_survives_kill_9(seaweed, bucket: str, mounter, tmp_path: Path) -> None:
    cache = tmp_path / "crash-cache"
    source = f"s3://{bucket}/{PREFIX.rstrip('/')}"
    m = mounter.mount(source, "--upload-delay", "600", env=s3env(seaweed), cache_dir=cache)
    closed = payload("closed", 3 * MiB)
    (m.path / "closed.bin").write_bytes(closed)
    fd = os.open(m.path / "synced.bin", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"fsynced")
    os.fsync(fd)
    os.write(fd, b" and more, never synced")  # may be lost, must not corrupt the object
    os.kill(m.pid, signal.SIGKILL)
    try:  # the descriptor died with the daemon: closing it may fail
        os.close(fd)
    except OSError:
        pass
    for _ in range(200):
        if not Path(f"/proc/{m.pid}").exists():
            break
        time.sleep(0.05)
    assert run_cli("unmount", str(m.path), env=m.env).returncode == 0
    m2 = mounter.mount(source, env=s3env(seaweed), cache_dir=cache, mountpoint=m.path)
    flush_ok(m2)
    files, _ = bucket_tree(seaweed, bucket)
    assert files["closed.bin"] == closed
    assert files["synced.bin"] in (b"fsynced", b"fsynced and more, never synced")


def test_write_through_uploads_before_close_returns_and_reports_failures(moto, mounter) -> None:
    # moto, because SeaweedFS quietly recreates a deleted bucket on the next PUT.
    bucket = f"wbt-{uuid.uuid4().hex[:12]}"
    moto.make_bucket(bucket)
    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", "--write-through", env=s3env(moto))
    client = moto.client()
    (m.path / "now.txt").write_bytes(b"in the bucket when close returns")
    assert client.get_object(Bucket=bucket, Key=PREFIX + "now.txt")["Body"].read() == b"in the bucket when close returns"
    # The bucket goes away under the mount: uploads fail with NoSuchBucket, close() reports it.
    client.delete_object(Bucket=bucket, Key=PREFIX + "now.txt")
    client.delete_bucket(Bucket=bucket)
    with pytest.raises(OSError) as info:
        with open(m.path / "fails.txt", "wb") as fh:
            fh.write(b"not uploaded")
    assert info.value.errno == errno.EIO
    assert (m.path / "fails.txt").read_bytes() == b"not uploaded"  # still staged, retried later
    status = run_cli("status", str(m.path / "fails.txt"), env=m.env)
    # dirty, or uploading when the status lands during a retry; either way the failure is named.
    assert status.stdout.split()[0] in ("dirty", "uploading") and "does not exist" in status.stdout, status.stdout
    wb = m.stats()["writeback"]
    assert wb["failed_attempts"] >= 1 and "does not exist" in (wb["last_error"] or "")
    moto.make_bucket(bucket)
    flush_ok(m)
    assert client.get_object(Bucket=bucket, Key=PREFIX + "fails.txt")["Body"].read() == b"not uploaded"


def test_fallocate_through_the_mount(seaweed, bucket: str, mounter) -> None:
    """fallocate(2) as programs call it (glibc's fallocate, posix_fallocate): grow, keep size, punch a
    hole, zero a range; collapse is refused with EOPNOTSUPP. The bytes read back and reach the bucket
    (issue 38, finding 7: EOPNOTSUPP in every mode)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]

    def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
        if libc.fallocate(fd, mode, offset, length) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))

    m = mounter.mount(f"s3://{bucket}/{PREFIX.rstrip('/')}", "--upload-delay", "0", env=s3env(seaweed))
    path = m.path / "prealloc.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 10_000)
        os.posix_fallocate(fd, 0, 20_000)  # grows to 20,000 (zeros)
        fallocate(fd, 0x01, 0, 1 << 20)  # KEEP_SIZE: nothing changes
        fallocate(fd, 0x02 | 0x01, 100, 200)  # punch a hole
        fallocate(fd, 0x10, 25_000, 5_000)  # zero range past the end: grows to 30,000
        with pytest.raises(OSError) as refused:
            fallocate(fd, 0x08, 0, 4096)  # collapse range
        assert refused.value.errno == errno.EOPNOTSUPP
        assert os.fstat(fd).st_size == 30_000
    finally:
        os.close(fd)
    expected = b"x" * 100 + bytes(200) + b"x" * 9_700 + bytes(20_000)
    assert path.read_bytes() == expected
    flush_ok(m)
    files, _ = bucket_tree(seaweed, bucket)
    assert files["prealloc.bin"] == expected
