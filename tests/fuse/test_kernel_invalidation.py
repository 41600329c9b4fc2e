"""A change made in the bucket behind the mount's back reaches the kernel when the daemon learns of
it, not when the kernel's own timeouts run out (FUSE_NOTIFY_INVAL_INODE and _ENTRY, issue 39).

The kernel keeps an entry for ``--dir-ttl`` from the moment it was handed over and a file's
attributes for ``--attr-ttl`` (an hour here). A directory listed again (``ls``) near the end of its
listing's life hands the kernel entries that outlive that listing; the daemon then lists the
directory again (here: a lookup of a name nobody has, which the kernel always sends) and finds one
file with a new version and one gone. Without notifications the kernel went on showing the old size
(and reading only that many bytes) and the file gone until its entries expired.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

DIR_TTL_S = 8.0
ATTR_TTL_S = 3600.0
OLD = b"old version\n" * 10
NEW = b"the new version, written by someone else\n" * 7


def s3env(server) -> dict[str, str]:
    return {**server.env(), "AWS_ENDPOINT_URL": server.endpoint_url}


def sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.monotonic()))


def test_a_change_behind_the_mounts_back_reaches_the_kernel_when_the_daemon_lists_it(moto, mounter) -> None:
    bucket = f"inval-{uuid.uuid4().hex[:12]}"
    moto.make_bucket(bucket)
    moto.put(bucket, "d/changed", OLD)
    moto.put(bucket, "d/gone", b"soon gone")
    m = mounter.mount(f"s3://{bucket}", "--dir-ttl", f"{DIR_TTL_S:g}", "--attr-ttl", f"{ATTR_TTL_S:g}",
                      env=s3env(moto))
    d = m.path / "d"
    start = time.monotonic()
    assert sorted(os.listdir(d)) == ["changed", "gone"]  # the daemon lists d: fresh until start + DIR_TTL_S
    assert (d / "changed").read_bytes() == OLD  # its pages are in the kernel's cache now
    sleep_until(start + DIR_TTL_S / 2)
    # Listed again from the same listing: the kernel's entries and attributes now last until
    # start + 1.5 * DIR_TTL_S (and a read's atime mark, which would make the next stat ask, is cleared).
    assert sorted(os.listdir(d)) == ["changed", "gone"]
    assert (d / "gone").stat().st_size == len(b"soon gone")

    moto.put(bucket, "d/changed", NEW)
    moto.delete(bucket, "d/gone")
    sleep_until(start + DIR_TTL_S + 0.5)
    assert not (d / "nobody").exists()  # a lookup the kernel always sends: the daemon lists d again
    relisted = time.monotonic()

    # Until the kernel's entries would have expired by themselves (with a margin for a busy machine);
    # stat only (a read would mark atime stale and make the next stat ask the daemon anyway).
    deadline = start + 1.5 * DIR_TTL_S - 1.0
    seen: tuple[int, bool] = (0, True)
    while time.monotonic() < deadline:
        seen = ((d / "changed").stat().st_size, (d / "gone").exists())
        if seen == (len(NEW), False):
            break
        time.sleep(0.05)
    assert relisted < deadline, "the machine was too slow to check before the kernel's entries expired"
    assert seen == (len(NEW), False)
    assert (d / "changed").read_bytes() == NEW  # no old page, and no read cut at the old size
    fuse = m.stats()["fuse"]
    assert fuse["inval_inodes"] >= 1 and fuse["inval_entries"] >= 2
    assert fuse["inval_errors"] == 0 and fuse["inval_dropped"] == 0
    assert m.unmount().returncode == 0
