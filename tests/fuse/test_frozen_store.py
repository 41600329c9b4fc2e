"""A frozen object store (connections accepted, never answered) never freezes the mount.

Two ways to freeze a private SeaweedFS after the test data is cached through a real mount:

* ``sigstop``: SIGSTOP of the server process this test started (its PID only; SIGCONT in a
  ``finally``). The kernel still accepts connections on its listening sockets; nothing answers.
* ``blackhole``: the mount reaches the server through ``LoopbackProxy``, a TCP proxy on 127.0.0.1
  that forwards until ``freeze()``, then accepts new connections and reads what is sent on any
  connection without ever answering; ``thaw()`` drops the connections it held and forwards again.

The mount uses small deadlines (``--metadata-timeout 2 --fetch-timeout 5``) and short TTLs, so every
operation below starts after its metadata expired. Each one is checked for its result (the data, or
EIO) and for liveness: it must return within three times its deadline plus 10 s (a thread bounds it,
so a hang fails the test instead of hanging the run). No duration is asserted beyond that. Then the
store is thawed and everything written during the freeze must reach the bucket byte for byte.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.fuse.conftest import read_dropping_page_cache, run_cli
from tests.fuse.writeback_support import LoopbackProxy, bounded, flush, get_bytes, s3env
from tests.support.s3servers import SeaweedS3

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

KiB, MiB = 1024, 1024 * 1024
METADATA_TIMEOUT_S = 2
FETCH_TIMEOUT_S = 5
MOUNT_ARGS = ("--metadata-timeout", str(METADATA_TIMEOUT_S), "--fetch-timeout", str(FETCH_TIMEOUT_S),
              "--attr-ttl", "1", "--dir-ttl", "1")
# Liveness bounds: three times the deadline that governs the operation, plus 10 s for a slow runner.
METADATA_BOUND_S = 3 * METADATA_TIMEOUT_S + 10
READ_BOUND_S = 3 * FETCH_TIMEOUT_S + 10
FLUSH_TIMEOUT_S = 3
CLI_BOUND_S = 3 * FLUSH_TIMEOUT_S + 10
# After the thaw: the circuit's probe runs every 5 s, uploads wait 2 s after close; a flush this long
# finds everything in the store unless something stayed stuck.
DRAIN_TIMEOUT_S = 120


@contextlib.contextmanager
def frozen_by_sigstop(server: SeaweedS3) -> Iterator[Callable[[], None]]:
    """Yields ``freeze``; the server is always continued on the way out."""
    pid = server.pid
    assert pid is not None
    try:
        yield lambda: os.kill(pid, signal.SIGSTOP)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# ------------------------------------------------------------------------------------------ operations
def read_file(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def write_file(path: Path, data: bytes, *, fsync: bool) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())


def expect_eio(fn: Callable[[], Any]) -> Callable[[], int]:
    def run() -> int:
        try:
            fn()
        except OSError as exc:
            return exc.errno or 0
        return 0

    return run


@pytest.mark.parametrize("how", ["sigstop", "blackhole"])
def test_a_frozen_store_never_freezes_the_mount(mounter, how: str) -> None:
    rng = random.Random(18)
    cached = rng.randbytes(3 * MiB + 123)
    uncached = rng.randbytes(300 * KiB)
    written_small = rng.randbytes(4 * MiB)
    written_large = rng.randbytes(40 * MiB)
    overwritten = rng.randbytes(200 * KiB)
    with SeaweedS3() as server, contextlib.ExitStack() as stack:
        bucket = f"frozen-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        server.put(bucket, "data/cached.bin", cached)
        server.put(bucket, "data/uncached.bin", uncached)
        server.put(bucket, "data/overwrite.bin", b"old" * 1000)
        server.put(bucket, "other/never-listed.bin", b"x")
        env = s3env(server)
        if how == "blackhole":
            proxy = LoopbackProxy(server.s3_port)
            stack.callback(proxy.close)
            env["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL_S3"] = proxy.endpoint_url  # _S3 wins, as for botocore
            freeze, thaw = proxy.freeze, proxy.thaw
        else:
            freeze = stack.enter_context(frozen_by_sigstop(server))
            pid = server.pid
            assert pid is not None

            def thaw() -> None:
                os.kill(pid, signal.SIGCONT)

        m = mounter.mount(f"s3://{bucket}", *MOUNT_ARGS, env=env)
        data_dir = m.path / "data"
        # Cache: the file (page cache and tiers), the listings of / and data/.
        assert read_file(data_dir / "cached.bin") == cached
        assert sorted(os.listdir(data_dir)) == ["cached.bin", "overwrite.bin", "uncached.bin"]
        assert m.stats()["store_health"]["state"] == "reachable"

        freeze()
        thawed = False
        try:
            threading.Event().wait(1.5)  # every TTL (1 s) has expired: each operation below revalidates

            # Reads of cached data: the data, within the metadata deadline (stale metadata).
            got = bounded(lambda: read_file(data_dir / "cached.bin"), METADATA_BOUND_S, "cached read")
            assert got == cached
            got = bounded(lambda: read_dropping_page_cache(data_dir / "cached.bin"), METADATA_BOUND_S,
                          "cached read, page cache dropped")
            assert got == cached
            st = bounded(lambda: os.stat(data_dir / "cached.bin"), METADATA_BOUND_S, "stat")
            assert st.st_size == len(cached)
            names = bounded(lambda: sorted(os.listdir(data_dir)), METADATA_BOUND_S, "ls of a listed directory")
            assert names == ["cached.bin", "overwrite.bin", "uncached.bin"]

            # What the store alone has: EIO, within the fetch / metadata deadline.
            code = bounded(expect_eio(lambda: read_file(data_dir / "uncached.bin")), READ_BOUND_S, "uncached read")
            assert code == errno.EIO
            code = bounded(expect_eio(lambda: os.listdir(m.path / "other")), METADATA_BOUND_S,
                           "ls of a never-listed directory")
            assert code == errno.EIO

            # Writes stage locally.
            bounded(lambda: write_file(data_dir / "new-small.bin", written_small, fsync=True), METADATA_BOUND_S,
                    "write 4 MiB + fsync")
            bounded(lambda: write_file(data_dir / "new-large.bin", written_large, fsync=False), METADATA_BOUND_S,
                    "write 40 MiB + close")
            bounded(lambda: write_file(data_dir / "overwrite.bin", overwritten, fsync=False), METADATA_BOUND_S,
                    "overwrite of an uploaded file")
            assert bounded(lambda: read_file(data_dir / "new-small.bin"), METADATA_BOUND_S, "read back") == written_small

            # The control API answers: flush (not ok), stats (unreachable), unmount (refuses: data pending).
            result = bounded(lambda: flush(m, FLUSH_TIMEOUT_S), CLI_BOUND_S, "cachefs flush --timeout")
            assert result.returncode != 0 and "new-large.bin" in result.stdout + result.stderr
            result = bounded(lambda: run_cli("stats", str(m.path), "--json", env=m.env), CLI_BOUND_S, "cachefs stats")
            assert result.returncode == 0, result.stderr
            health = json.loads(result.stdout)["store_health"]
            assert health["state"] == "unreachable" and health["outages"] >= 1
            result = bounded(lambda: run_cli("unmount", str(m.path), "--flush-timeout", str(FLUSH_TIMEOUT_S),
                                             env=m.env), CLI_BOUND_S, "cachefs unmount")
            assert result.returncode != 0 and m.mounted, result.stderr

            thaw()
            thawed = True
        finally:
            if not thawed:
                thaw()

        # Thawed: everything written during the freeze reaches the bucket, byte for byte.
        result = bounded(lambda: flush(m, DRAIN_TIMEOUT_S), DRAIN_TIMEOUT_S + 30, "cachefs flush after the thaw")
        assert result.returncode == 0, result.stdout + result.stderr
        client = server.client()
        assert get_bytes(client, bucket, "data/new-small.bin") == written_small
        assert get_bytes(client, bucket, "data/new-large.bin") == written_large
        assert get_bytes(client, bucket, "data/overwrite.bin") == overwritten
        assert bounded(lambda: read_file(data_dir / "uncached.bin"), READ_BOUND_S, "uncached read after") == uncached
        assert m.stats()["store_health"]["state"] == "reachable"
        result = bounded(m.unmount, CLI_BOUND_S + 60, "cachefs unmount after the thaw")
        assert result.returncode == 0, result.stderr
