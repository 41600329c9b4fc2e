"""Write-back when the store goes away, and when the disk tier is smaller than what is written.

Outage: a private SeaweedFS is stopped while files are being written. Writes, overwrites, unlinks and
mkdirs keep succeeding into staging and read back at once; ``cachefs flush --timeout 5`` exits
non-zero naming every pending path; ``cachefs unmount`` refuses; ``cachefs status`` and the stats
say the data is dirty and the store unreachable. When the server is back the backlog drains on its own (bounded wait: the retry
backoff is capped at a minute), ``cachefs flush`` succeeds and the bucket holds exactly the files
written.

Back-pressure: ``--disk-cache 64MiB`` and 200 MiB written in 8 MiB files while uploads go through a
proxy that limits them to 40 MiB/s, so writers outrun the uploads and must wait for staging space.
Every write succeeds, every byte is in the bucket after ``cachefs flush``, and a background thread
sampling the cache directory every few milliseconds never sees more than the cap. What is counted is
what the disk tier accounts for: every file under ``blocks/`` (its size), every staged data file
under ``staging/data/`` (its size rounded up to 4 KiB, the filesystem block), every journal record
under ``staging/records/`` (4 KiB each). Not counted, as fixed overhead outside the capacity:
``source.json``, ``lock``, ``pins.json``, ``staging/FORMAT``, the daemon's log, and temporary
record files that exist only while a record is being replaced (``records/.tmp-*``, one 4 KiB file
per record write in progress; the test allows at most ``MAX_TMP_RECORDS`` of them at once).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.fuse.conftest import run_cli
from tests.fuse.writeback_support import (
    LoopbackProxy,
    bounded,
    flush,
    flush_ok,
    get_bytes,
    list_keys,
    read_bucket,
    s3env,
    sha256,
)
from tests.support.s3servers import SeaweedS3

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

KiB, MiB = 1024, 1024 * 1024
# A write into staging during an outage must not wait for the store; this bound is for a slow runner.
OUTAGE_WRITE_TIMEOUT_S = 30
# The uploader's retry backoff is capped at 60 s (tiering.writeback.settings): a store that comes
# back is noticed within that, plus the time to upload a few MiB.
DRAIN_ON_ITS_OWN_S = 90
FS_BLOCK = 4096
MAX_TMP_RECORDS = 16


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def test_store_outage_writes_stage_then_drain(mounter, tmp_path: Path) -> None:
    with SeaweedS3() as server:
        bucket = f"wbout-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        client = server.client()
        m = mounter.mount(f"s3://{bucket}/out", "--connect-timeout", "1", "--read-timeout", "2",
                          "--fetch-timeout", "3", env=s3env(server))
        rng = random.Random(7)
        files: dict[str, bytes] = {
            "a1.bin": rng.randbytes(300 * KiB),
            "a2.bin": rng.randbytes(2 * MiB),
            "keep/a3.bin": rng.randbytes(10 * KiB),
        }
        (m.path / "keep").mkdir()
        for name, data in files.items():
            _write(m.path / name, data)
        flush_ok(m)
        assert read_bucket(client, bucket, "out/")[0] == files

        server.stop_keep_data()
        try:
            during: dict[str, bytes] = {
                "b1.bin": rng.randbytes(64 * KiB),
                "b2.bin": rng.randbytes(24 * MiB),  # large enough for a multipart upload
                "newdir/b3.bin": rng.randbytes(5 * KiB),
                "a1.bin": rng.randbytes(100 * KiB),  # overwrite of an object in the store (O_TRUNC)
            }

            def outage_writes() -> None:
                (m.path / "newdir").mkdir()
                for name, data in during.items():
                    _write(m.path / name, data)
                with open(m.path / "b1.bin", "ab") as fh:  # append to a staged file
                    fh.write(b"tail")
                os.unlink(m.path / "a2.bin")

            bounded(outage_writes, OUTAGE_WRITE_TIMEOUT_S, "writes while the store is down")
            during["b1.bin"] += b"tail"
            files.update(during)
            del files["a2.bin"]
            # Read-after-write, straight from staging.
            for name, data in during.items():
                assert bounded(lambda p=m.path / name: p.read_bytes(), OUTAGE_WRITE_TIMEOUT_S, f"read {name}") == data
            assert not (m.path / "a2.bin").exists()

            result = flush(m, 5)
            output = result.stdout + result.stderr
            assert result.returncode != 0, f"cachefs flush succeeded with the store down:\n{output}"
            for name in ("b1.bin", "b2.bin", "newdir/b3.bin", "a1.bin", "a2.bin"):
                assert name in output, f"cachefs flush does not name pending {name!r}:\n{output}"

            refused = run_cli("unmount", str(m.path), "--flush-timeout", "2", env=m.env)
            assert refused.returncode != 0 and m.mounted, "cachefs unmount went ahead while the store was down"

            status = run_cli("status", str(m.path / "b2.bin"), str(m.path / "keep" / "a3.bin"), env=m.env)
            assert status.returncode == 0, f"cachefs status failed: {status.stderr}"
            lines = status.stdout.splitlines()
            b2_line = next((line for line in lines if "b2.bin" in line), "")
            a3_line = next((line for line in lines if "a3.bin" in line), "")
            assert "dirty" in b2_line, f"cachefs status does not call b2.bin dirty:\n{status.stdout}"
            assert "clean" in a3_line, f"cachefs status does not call keep/a3.bin clean:\n{status.stdout}"

            wb = m.stats()["writeback"]
            print(f"\nwrite-back stats during the outage: {json.dumps(wb, sort_keys=True)}")
            assert wb["dirty_files"] >= 4 and wb["dirty_bytes"] >= 24 * MiB
            assert wb["failed_attempts"] > 0
            assert wb["store_state"] != "ok"
        finally:
            server.start()

        # The backlog drains on its own, without a flush.
        back = time.monotonic()
        deadline = back + DRAIN_ON_ITS_OWN_S
        while read_bucket_safe(client, bucket) != files:
            assert time.monotonic() < deadline, (
                f"the backlog did not drain on its own within {DRAIN_ON_ITS_OWN_S} s of the store coming back; "
                f"stats: {json.dumps(m.stats().get('writeback'), sort_keys=True)}"
            )
            time.sleep(1.0)
        print(f"the backlog drained on its own {time.monotonic() - back:.1f} s after the store came back")
        flush_ok(m)
        got, _markers = read_bucket(client, bucket, "out/")
        assert got == files
        assert m.stats()["writeback"]["dirty_files"] == 0


def read_bucket_safe(client, bucket: str) -> dict[str, bytes] | None:
    try:
        return read_bucket(client, bucket, "out/")[0]
    except Exception:  # noqa: BLE001 - the server is still starting: try again
        return None


# -- back-pressure ----------------------------------------------------------------------------------


def accounted(source_dir: Path) -> tuple[int, int]:
    """``(bytes the disk tier accounts for, temporary record files)`` in ``source_dir`` (see the docstring)."""
    total = 0
    tmp_records = 0
    for dirpath, _dirs, names in os.walk(source_dir / "blocks"):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    for dirpath, _dirs, names in os.walk(source_dir / "packs"):  # small blocks: what the packs hold on disk
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    for dirpath, _dirs, names in os.walk(source_dir / "staging"):
        kind = Path(dirpath).relative_to(source_dir / "staging").parts[:1]
        for name in names:
            if kind == ("records",):
                if name.startswith(".tmp-"):
                    tmp_records += 1
                else:
                    total += FS_BLOCK
            elif kind in (("data",), ("quarantine",)):
                try:
                    size = os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
                total += -(-size // FS_BLOCK) * FS_BLOCK
    return total, tmp_records


class Sampler(threading.Thread):
    def __init__(self, source_dir: Path, interval_s: float = 0.005) -> None:
        super().__init__(daemon=True, name="cache-dir-sampler")
        self.source_dir = source_dir
        self.interval_s = interval_s
        self.stop = threading.Event()
        self.samples = 0
        self.max_bytes = 0
        self.max_tmp = 0

    def run(self) -> None:
        while not self.stop.is_set():
            used, tmp = accounted(self.source_dir)
            self.samples += 1
            self.max_bytes = max(self.max_bytes, used)
            self.max_tmp = max(self.max_tmp, tmp)
            self.stop.wait(self.interval_s)


def test_back_pressure_small_disk_tier_slow_store(seaweed, mounter, tmp_path: Path) -> None:
    cap = 64 * MiB
    total_files, file_size = 25, 8 * MiB  # 200 MiB, 3x the tier
    bucket = f"wbbp-{uuid.uuid4().hex[:8]}"
    seaweed.make_bucket(bucket)
    client = seaweed.client()
    with LoopbackProxy(seaweed.s3_port, 40 * MiB) as proxy:
        env = {**s3env(seaweed), "AWS_ENDPOINT_URL": proxy.endpoint_url, "AWS_ENDPOINT_URL_S3": proxy.endpoint_url}
        m = mounter.mount(f"s3://{bucket}/bp", "--disk-cache", "64MiB", "--endpoint-url", proxy.endpoint_url,
                          env=env)
        sources = [p.parent for p in m.cache_dir.glob("*/source.json")]
        assert len(sources) == 1, f"expected one source directory in {m.cache_dir}: {sources}"
        sampler = Sampler(sources[0])
        sampler.start()
        digests: dict[str, str] = {}
        errors: list[str] = []

        def writer(worker: int) -> None:
            for i in range(worker, total_files, 2):
                name = f"f{i:02d}.bin"
                data = random.Random(i).randbytes(file_size)
                try:
                    _write(m.path / name, data)
                    digests[name] = sha256(data)
                except OSError as exc:
                    errors.append(f"{name}: {exc}")

        try:
            threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
                assert not t.is_alive(), "a writer is still blocked after 300 s"
            wb_after_writes = m.stats()["writeback"]
            flush_ok(m)
        finally:
            sampler.stop.set()
            sampler.join(10)
        assert not errors, f"writes failed under back-pressure: {errors}"
        objects = list_keys(client, bucket, "bp/")
        assert {k: v["size"] for k, v in objects.items()} == {f"bp/{n}": file_size for n in digests}
        for name, digest in digests.items():
            assert sha256(get_bytes(client, bucket, f"bp/{name}")) == digest, f"bp/{name} differs"
        print(f"\nback-pressure: {total_files * file_size // MiB} MiB written through a {cap // MiB} MiB disk tier; "
              f"{sampler.samples} samples of the cache directory, peak {sampler.max_bytes / MiB:.1f} MiB accounted, "
              f"peak {sampler.max_tmp} temporary record files; stats after the writes: "
              f"{json.dumps(wb_after_writes, sort_keys=True)}")
        assert sampler.samples > 10
        assert sampler.max_bytes <= cap, f"the cache directory held {sampler.max_bytes} bytes, the cap is {cap}"
        assert sampler.max_tmp <= MAX_TMP_RECORDS
        # The writers really outran the uploads: staging filled up and writers waited for space.
        assert sampler.max_bytes > cap // 2, "staging never filled: the test did not exercise back-pressure"
        assert m.stats()["writeback"]["space_waits"] > 0


def test_enospc_when_staging_is_full_and_the_store_is_down(mounter, tmp_path: Path) -> None:
    """Back-pressure that cannot be relieved: with the store down, a writer that fills the disk tier
    waits ``--dirty-wait`` seconds, then gets ENOSPC (and the log says why); everything acknowledged
    before stays staged and reaches the bucket once the store is back."""
    with SeaweedS3() as server:
        bucket = f"wbnospc-{uuid.uuid4().hex[:8]}"
        server.make_bucket(bucket)
        client = server.client()
        m = mounter.mount(f"s3://{bucket}/x", "--disk-cache", "16MiB", "--dirty-wait", "2",
                          "--connect-timeout", "1", "--read-timeout", "2", env=s3env(server))
        # Creating a name needs the directory's listing (is the name in the store?): list it while the
        # store is up. A directory never listed before an outage answers EIO to lookups, by design.
        assert os.listdir(m.path) == []
        server.stop_keep_data()
        acked: dict[str, bytes] = {}
        failed: tuple[str, bytes, OSError] | None = None
        try:
            for i in range(16):  # 16 x 2 MiB = twice the tier
                name, data = f"f{i:02d}.bin", random.Random(i).randbytes(2 * MiB)
                try:
                    bounded(lambda n=name, d=data: _write(m.path / n, d), 60, f"writing {name}")
                except OSError as exc:
                    failed = (name, data, exc)
                    break
                acked[name] = data
            assert failed is not None, "16 MiB of disk cache took 32 MiB of staged data with the store down"
            name, data, exc = failed
            assert exc.errno == 28, f"{name}: expected ENOSPC, got {exc!r}"  # errno.ENOSPC
            assert len(acked) >= 4, f"ENOSPC after only {len(acked)} files of 2 MiB in a 16 MiB tier"
            for n, d in acked.items():
                assert (m.path / n).read_bytes() == d
            logs = [p for p in m.cache_dir.glob("*/daemon.log*")]
            assert any("ENOSPC" in p.read_text(errors="replace") for p in logs), f"no ENOSPC line in {logs}"
        finally:
            server.start()
        flush_ok(m)
        got = read_bucket(client, bucket, "x/")[0]
        for n, d in acked.items():
            assert got.get(n) == d, f"acknowledged {n} is not in the bucket as written"
        # The file whose write failed: absent, or what was written before the failure (a prefix).
        assert set(got) - set(acked) <= {name}
        assert name not in got or data.startswith(got[name])
        print(f"\nENOSPC after {len(acked)} acknowledged files of 2 MiB in a 16 MiB disk tier; all of them uploaded "
              f"once the store was back")
